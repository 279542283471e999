"""Generate the rpc_observe Grafana dashboard (``dashboards/rpc_observe.json``).

The dashboard is code: it is built with Grafana's official foundation SDK
(``grafana-foundation-sdk``, the Grafana 11.6 flavour, pinned in
``SDK_REQUIREMENT`` because the output depends on the SDK version) and the
generated JSON is committed next to this file.  Grafana provisions that JSON
(see ``deploy/grafana/provisioning``).

Usage::

    pip install 'grafana-foundation-sdk==1769699379!11.6.0'
    python dashboards/generate.py            # rewrite rpc_observe.json
    python dashboards/generate.py --check    # exit 1 if the committed file is stale

Either way it exits 1 if a query names a metric that ``rpc_observe/telemetry/declarations.py``
does not declare.

``build_dashboard()`` assembles the dashboard's settings, variables and
annotation and its rows, one function per row (``_overview_row()``,
``_latency_row()``, ...), built from small panel helpers (``_ts``, ``_stat``,
``_table``) and PromQL helpers (``_sum_rate``, ``_quantile``, ``_mean``,
``_range_mean``).
The SDK is imported inside those functions only.

Besides the generator this module offers helpers that need no SDK, for
tests that run the panels' PromQL against a real Prometheus:

* ``panel_queries(dashboard_json)`` -> ``[(panel_title, expr), ...]``
* ``annotation_queries(dashboard_json)`` and ``variable_selectors(dashboard_json)``
  for the annotation queries and the series selectors of the variables
* ``referenced_metrics(dashboard_json)`` and ``undeclared_metrics(dashboard_json)``: the
  metric names the queries use, and those rpc_observe does not declare
* ``substitute_variables(expr, ...)`` -> plain PromQL with ``$job``,
  ``$worker``, ``$method``, ``$__rate_interval``, ``$__interval``,
  ``$__range`` (and their ``${...}`` forms) replaced.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the SDK itself is imported where it is used: the helpers below need none
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.cog import variants as cogvariants
    from grafana_foundation_sdk.models import dashboard as dm

    # A dashboard row: its title and its panels.
    _Row = tuple[str, list[cogbuilder.Builder[dm.Panel]]]

SDK_DISTRIBUTION = "grafana_foundation_sdk"
SDK_VERSION = "1769699379!11.6.0"  # the SDK generated for Grafana v11.6.x
SDK_REQUIREMENT = f"grafana-foundation-sdk=={SDK_VERSION}"

OUTPUT = Path(__file__).resolve().with_name("rpc_observe.json")

DASHBOARD_UID = "rpc-observe"
DASHBOARD_TITLE = "rpc_observe: torch.distributed.rpc"

# Fixed datasource uids; deploy/grafana/provisioning/datasources/datasources.yml
# provisions exactly these.
PROMETHEUS_UID = "rpc_observe_prometheus"
PROMETHEUS_NAME = "Prometheus"
JAEGER_UID = "rpc_observe_jaeger"
JAEGER_NAME = "Jaeger"

# The Jaeger UI as published by docker-compose.yml, for links opened in the browser.
JAEGER_UI_URL = "http://localhost:16686"
# rpc_observe reports each worker's spans under service.name = the worker's name,
# unless OTEL_SERVICE_NAME is set.  Links from series that carry a `worker` label
# use it; the others use the `trace_service` variable (a worker, or a typed name).
TRACE_SERVICE_FROM_SERIES = "${__field.labels.worker}"
TRACE_SERVICE_FROM_VARIABLE = "${trace_service}"
# Span attribute holding the RPC's function name (OpenTelemetry RPC semantic conventions).
TRACE_METHOD_ATTRIBUTE = "rpc.method"

# Above this share of storage bytes sent without being part of a tensor, the
# wasted-storage stat turns red (e.g. sending a small view of a big tensor).
WASTED_STORAGE_RED = 0.5

# A call in flight or a UDF running for longer than this is stuck: the default of
# RPC_OBSERVE_HANG_SECONDS (half torch's default 60 s RPC timeout, so that the evidence
# is dumped before torch's timeout clears the call).  The age panels turn red above it;
# deploy/prometheus/rules/rpc_observe.rules.yml alerts at the same value.
STUCK_SECONDS = 30

ALL_VALUE = ".*"

# Label filters.  Every query is filtered by job and worker; metrics that carry
# a `method` label are filtered by method too.
JOB_WORKER = 'job=~"$job", worker=~"$worker"'
JOB_WORKER_METHOD = 'job=~"$job", worker=~"$worker", method=~"$method"'
# Server-side series paired with client-side ones (latency breakdown): every
# callee's run time of the selected methods.  The server histogram carries no
# caller (`src`) by default, so that its series do not grow with the world size
# (RPC_OBSERVE_PEER_LABELS=histograms adds it back; these queries sum it away).
JOB_CALLEE_METHOD = 'job=~"$job", method=~"$method"'

RPC_METRICS_SELECTOR = '{__name__=~"torch_rpc_.+|rpc_observe_.+"'


# --------------------------------------------------------------------------
# Helpers that need no SDK
# --------------------------------------------------------------------------


def _loaded(dashboard_json: Mapping[str, Any] | str) -> Mapping[str, Any]:
    """The dashboard as a mapping, parsed first if it is JSON text."""
    return json.loads(dashboard_json) if isinstance(dashboard_json, str) else dashboard_json


def _walk_panels(panels: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    """Every panel, each row followed by the panels it holds (collapsed rows hold theirs)."""
    for panel in panels or ():
        yield panel
        # Collapsed rows keep their panels inside the row.
        yield from _walk_panels(panel.get("panels") or ())


def panel_queries(dashboard_json: Mapping[str, Any] | str) -> list[tuple[str, str]]:
    """Return ``(panel_title, expr)`` for every PromQL target of every panel.

    Accepts the dashboard as a dict or as JSON text.  Rows are descended into.
    Hidden targets are included (they are still queried by Grafana when other
    targets reference them).
    """
    dashboard = _loaded(dashboard_json)
    out: list[tuple[str, str]] = []
    for panel in _walk_panels(dashboard.get("panels") or ()):
        for target in panel.get("targets") or ():
            expr = target.get("expr")
            if expr:
                out.append((panel.get("title", ""), expr))
    return out


def annotation_queries(dashboard_json: Mapping[str, Any] | str) -> list[tuple[str, str]]:
    """Return ``(annotation_name, expr)`` for every Prometheus annotation query."""
    dashboard = _loaded(dashboard_json)
    out: list[tuple[str, str]] = []
    for annotation in (dashboard.get("annotations") or {}).get("list") or ():
        expr = annotation.get("expr") or (annotation.get("target") or {}).get("expr")
        if expr:
            out.append((annotation.get("name", ""), expr))
    return out


_METRIC_NAME = re.compile(r"\b((?:torch_rpc|rpc_observe)_[a-z_]+)")


def referenced_metrics(dashboard_json: Mapping[str, Any] | str) -> set[str]:
    """Every rpc_observe sample name the panels, annotations and variables query."""
    dashboard = _loaded(dashboard_json)
    exprs = [expr for _, expr in panel_queries(dashboard) + annotation_queries(dashboard)]
    exprs += [selector for _, selector, _ in variable_selectors(dashboard)]
    return {name for expr in exprs for name in _METRIC_NAME.findall(expr)}


def undeclared_metrics(dashboard_json: Mapping[str, Any] | str) -> list[str]:
    """The sample names the dashboard queries that rpc_observe/telemetry/declarations.py does not declare."""
    from rpc_observe.telemetry.declarations import sample_names

    return sorted(referenced_metrics(dashboard_json) - sample_names())


_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.*),\s*(?P<label>\w+)\)", re.DOTALL)


def variable_selectors(dashboard_json: Mapping[str, Any] | str) -> list[tuple[str, str, str]]:
    """Return ``(variable_name, series_selector, label)`` for each ``label_values`` variable.

    The selector is PromQL (after ``substitute_variables``), e.g. for
    ``/api/v1/series?match[]=...``.
    """
    dashboard = _loaded(dashboard_json)
    out: list[tuple[str, str, str]] = []
    for variable in (dashboard.get("templating") or {}).get("list") or ():
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        match = _LABEL_VALUES.fullmatch((query or "").strip())
        if match:
            out.append((variable["name"], match["selector"].strip(), match["label"]))
    return out


_VARIABLE = re.compile(r"\$\{(?P<braced>\w+)(?::(?P<fmt>[^}]*))?\}|\$(?P<bare>\w+)|\[\[(?P<old>\w+)\]\]")


def substitute_variables(
    expr: str,
    *,
    job: str = ALL_VALUE,
    worker: str = ALL_VALUE,
    method: str = ALL_VALUE,
    rate_interval: str = "1m",
    interval: str = "15s",
    range_: str = "1h",
    extra: Mapping[str, str] | None = None,
) -> str:
    """Replace Grafana variables in ``expr`` so that Prometheus can run it as is.

    ``job``, ``worker`` and ``method`` are regular expressions, as Grafana puts
    them in ``=~"..."`` matchers (the default ``.*`` is the dashboard's "All").
    ``rate_interval`` should be at least four scrape intervals, as Grafana's
    ``$__rate_interval`` is.  ``extra`` adds or overrides variables.  An
    unknown variable raises ``KeyError`` so that a new dashboard variable cannot
    go unnoticed.
    """
    values = {
        "job": job,
        "worker": worker,
        "method": method,
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
    }
    if extra:
        values.update(extra)

    def replace(match: re.Match[str]) -> str:
        """The value of the variable ``match`` found."""
        name = match.group("braced") or match.group("bare") or match.group("old")
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


# --------------------------------------------------------------------------
# PromQL shared by the panels (no SDK)
# --------------------------------------------------------------------------

REQUESTS = "torch_rpc_client_requests_total"
CLIENT_ERRORS = "torch_rpc_client_errors_total"
CLIENT_DURATION = "torch_rpc_client_duration_seconds"
SERVER_DURATION = "torch_rpc_server_duration_seconds"
# Each call's client duration = CALLEE (the callee's own time, from unpickling the request
# to pickling the response, as it reported it) + OUTSIDE (queueing in the callee's pool,
# (de)serialization, the wire).
CALLEE = "torch_rpc_client_callee_seconds"
OUTSIDE = "torch_rpc_client_outside_seconds"

# Workers whose RPC thread pool is fully busy: the annotation and a stat panel.
NO_IDLE_EXPR = f"min by (job, worker) (torch_rpc_agent_idle_threads{{{JOB_WORKER}}}) == 0"


def _sum_rate(metric: str, by: str | None = None, selector: str = JOB_WORKER_METHOD) -> str:
    """``sum by (<by>) (rate(<metric>{<selector>}[$__rate_interval]))``; a plain ``sum`` without ``by``."""
    inner = f"rate({metric}{{{selector}}}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def _quantile(q: float, by: str = "le", metric: str = CLIENT_DURATION, selector: str = JOB_WORKER_METHOD) -> str:
    """The ``q`` quantile of the histogram ``metric`` per ``by`` (which includes ``le``)."""
    return f"histogram_quantile({q}, {_sum_rate(f'{metric}_bucket', by, selector)})"


def _mean(metric: str, by: str | None, selector: str = JOB_WORKER_METHOD) -> str:
    """The mean observation of the histogram ``metric`` per ``by``; no value where nothing was observed."""
    return f"{_sum_rate(f'{metric}_sum', by, selector)} / ({_sum_rate(f'{metric}_count', by, selector)} > 0)"


def _range_mean(metric: str, by: str, selector: str = JOB_WORKER_METHOD) -> str:
    """The mean observation of the histogram ``metric`` per ``by`` over the dashboard's time range."""

    def increase(series: str) -> str:
        return f"sum by ({by}) (increase({metric}_{series}{{{selector}}}[$__range]))"

    return f"{increase('sum')} / ({increase('count')} > 0)"


# --------------------------------------------------------------------------
# The dashboard (the SDK is imported inside the functions, so that the
# helpers above work without it)
# --------------------------------------------------------------------------


def _prom_ds() -> dm.DataSourceRef:
    """The Prometheus datasource picked by the ``datasource`` variable."""
    from grafana_foundation_sdk.models import dashboard as dm

    return dm.DataSourceRef(type_val="prometheus", uid="${datasource}")


def _query(expr: str, legend: str, *, instant: bool = False, fmt: str | None = None,
           exemplars: bool = False) -> prometheus.Dataquery:
    """A PromQL target: a range query unless ``instant``; ``fmt`` is "table" or "heatmap" if not a time series;
    ``exemplars``: the histogram's exemplars as points that open their trace (the datasource's trace_id link)."""
    from grafana_foundation_sdk.builders import prometheus
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    query = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(_prom_ds())
    query = query.instant() if instant else query.range()
    if exemplars:
        query = query.exemplar(True)
    return query.format(PromQueryFormat(fmt)) if fmt else query


def _ref_ids(queries: Iterable[prometheus.Dataquery]) -> list[cogbuilder.Builder[cogvariants.Dataquery]]:
    """The queries with ref ids A, B, C, ... in order, as Grafana's query editor names them."""
    return [query.ref_id(chr(ord("A") + i)) for i, query in enumerate(queries)]


def _thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    """Absolute thresholds from ``(value, color)`` steps, the first one's value being ``None``."""
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.models import dashboard as dm

    return (dash.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=value, color=color) for value, color in steps]))


def _ts(title: str, description: str, unit: str, *targets: prometheus.Dataquery, width: int = 12,
        links: list[cogbuilder.Builder[dm.DashboardLink]] | None = None,
        min_zero: bool = True) -> timeseries.Panel:
    """A time series panel, 8 high, with a table legend and a shared, sorted tooltip."""
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import timeseries
    from grafana_foundation_sdk.models import common

    panel = (timeseries.Panel().title(title).description(description)
             .datasource(_prom_ds()).unit(unit).span(width).height(8)
             .line_width(1).fill_opacity(10).show_points(common.VisibilityMode.NEVER)
             .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True)
                     .calcs(["mean", "max", "lastNotNull"]))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING))
             .targets(_ref_ids(targets)))
    if min_zero:
        panel = panel.min(0)
    if links:
        panel = panel.data_links(links)
    return panel


def _stat(title: str, description: str, unit: str, decimals: int, *targets: prometheus.Dataquery,
          red_from: float | None = None) -> stat.Panel:
    """An 8 x 8 stat panel of the last values; with ``red_from``, green below that value and red from it on."""
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import stat
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import dashboard as dm

    panel = (stat.Panel().title(title).description(description)
             .datasource(_prom_ds()).span(8).height(8).unit(unit).decimals(decimals)
             .targets(_ref_ids(targets))
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    if red_from is not None:
        panel = (panel.thresholds(_thresholds((None, "green"), (red_from, "red")))
                 .color_scheme(dash.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
                 .color_mode(common.BigValueColorMode.BACKGROUND)
                 .graph_mode(common.BigValueGraphMode.AREA))
    return panel


def _table(title: str, description: str, expr: str, *transformations: tuple[str, dict[str, Any]],
           width: int, height: int, decimals: int) -> table.Panel:
    """A table of an instant query, reshaped by ``(transformer id, options)`` pairs in order."""
    from grafana_foundation_sdk.builders import table
    from grafana_foundation_sdk.models import dashboard as dm

    return (table.Panel().title(title).description(description)
            .datasource(_prom_ds()).span(width).height(height).decimals(decimals)
            .targets(_ref_ids([_query(expr, "", instant=True, fmt="table")]))
            .transformations([dm.DataTransformerConfig(id_val=id_val, options=options)
                              for id_val, options in transformations]))


def _matrix_table(title: str, description: str, unit: str, expr: str) -> table.Panel:
    """A worker x destination table of ``expr``, which is summed by (worker, dst)."""
    return _table(title, description, expr,
                  ("groupingToMatrix", {"rowField": "worker", "columnField": "dst", "valueField": "Value",
                                        "emptyValue": "zero"}),
                  ("organize", {"renameByName": {"worker\\dst": "worker → dst"}}),
                  width=8, height=9, decimals=2).unit(unit)


def _trace_links(by_method: bool,
                 service: str = TRACE_SERVICE_FROM_VARIABLE) -> list[cogbuilder.Builder[dm.DashboardLink]]:
    """Links from a latency point to traces at least that slow, in the Jaeger UI and in Grafana Explore.

    ``${__value.raw}`` is the clicked latency in seconds, a valid Go
    duration with an "s" appended, which is what Jaeger's minDuration takes.
    Jaeger's search needs a service: ``service`` is the series' worker or
    the ``trace_service`` variable.
    """
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.models import dashboard as dm

    class DataLink(dm.DashboardLink, cogbuilder.Builder[dm.DashboardLink]):
        """A field data link (the SDK has none), its own builder: an external URL, or an ``internal`` link."""

        def __init__(self, title: str, url: str = "", internal: dict[str, Any] | None = None) -> None:
            super().__init__(title=title, url=url, target_blank=internal is None)
            self.internal = internal

        def build(self) -> dm.DashboardLink:
            return self

        def to_json(self) -> dict[str, object]:
            if self.internal is None:
                return {"title": self.title, "url": self.url, "targetBlank": self.target_blank}
            return {"title": self.title, "url": self.url, "internal": self.internal}

    tags_url = ""
    tags_query = ""
    if by_method:
        # {"rpc.method":"<method>"}, URL-encoded around the (Grafana-encoded) value.
        tags_url = f"&tags=%7B%22{TRACE_METHOD_ATTRIBUTE}%22%3A%22${{__field.labels.method}}%22%7D"
        tags_query = f'{TRACE_METHOD_ATTRIBUTE}="${{__field.labels.method}}"'
    jaeger_url = (f"{JAEGER_UI_URL}/search?service={service}{tags_url}"
                  "&minDuration=${__value.raw}s&lookback=custom"
                  "&start=${__from}000&end=${__to}000&limit=20")
    explore_query: dict[str, Any] = {
        "refId": "A",
        "datasource": {"type": "jaeger", "uid": JAEGER_UID},
        "queryType": "search",
        "service": service,
        "minDuration": "${__value.raw}s",
        "limit": 20,
    }
    if tags_query:
        explore_query["tags"] = tags_query
    suffix = " of this method" if by_method else ""
    return [
        DataLink(f"Traces{suffix} slower than ${{__value.text}} (Jaeger UI)", url=jaeger_url),
        DataLink(f"Traces{suffix} slower than ${{__value.text}} (Grafana Explore)",
                 internal={"datasourceUid": JAEGER_UID, "datasourceName": JAEGER_NAME, "query": explore_query}),
    ]


def _query_variable(name: str, label: str, definition: str, *, multi: bool = True) -> dash.QueryVariable:
    """A variable of label values, refreshed with the time range; if ``multi``, with "All" meaning ``.*``."""
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.models import dashboard as dm

    variable = (dash.QueryVariable(name).label(label).datasource(_prom_ds()).query(definition)
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dm.VariableSort.ALPHABETICAL_ASC)
                .multi(multi).include_all(multi))
    if multi:
        variable = (variable.all_value(ALL_VALUE)
                    .current(dm.VariableOption(text=["All"], value=["$__all"], selected=True)))
    return variable


def _variables() -> list[cogbuilder.Builder[dm.VariableModel]]:
    """The datasource, the job / worker / method filters, and the service the trace links search."""
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.models import dashboard as dm

    return [
        (dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
         .current(dm.VariableOption(text=PROMETHEUS_NAME, value=PROMETHEUS_UID, selected=True))),
        _query_variable("job", "Job", f"label_values({RPC_METRICS_SELECTOR}}}, job)"),
        _query_variable("worker", "Worker", f'label_values({RPC_METRICS_SELECTOR}, job=~"$job"}}, worker)'),
        _query_variable(
            "method", "Method",
            'label_values({__name__=~"torch_rpc_client_requests_total|'
            'torch_rpc_server_duration_seconds_count|torch_rpc_serialized_bytes_count", '
            'job=~"$job", worker=~"$worker"}, method)'),
        (_query_variable("trace_service", "Trace service",
                         f'label_values({RPC_METRICS_SELECTOR}, job=~"$job", worker=~"$worker"}}, worker)',
                         multi=False)
         .description("service.name whose traces the latency panels link to: rpc_observe names "
                      "spans after the worker, unless the job sets OTEL_SERVICE_NAME (type it)")
         .allow_custom_value(True)),
    ]


def _no_idle_annotation() -> cogbuilder.Builder[dm.AnnotationQuery]:
    """The annotation marking the times when a worker has no idle RPC thread."""
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.models import dashboard as dm

    class PromAnnotation(dm.AnnotationQuery, cogbuilder.Builder[dm.AnnotationQuery]):
        """A Prometheus annotation query with the fields Grafana's editor sets, its own builder."""

        def __init__(self, title_format: str, tag_keys: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.title_format = title_format
            self.tag_keys = tag_keys

        def build(self) -> dm.AnnotationQuery:
            return self

        def to_json(self) -> dict[str, object]:
            return {**super().to_json(), "titleFormat": self.title_format, "tagKeys": self.tag_keys,
                    "textFormat": "", "step": "", "useValueForTime": False}

    return PromAnnotation(
        name="No idle RPC threads", datasource=_prom_ds(), enable=True, hide=False, icon_color="red",
        expr=NO_IDLE_EXPR, title_format="No idle RPC threads on {{worker}}", tag_keys="worker")


# -- rows: each returns its title and its panels ------------------------------


def _overview_row() -> _Row:
    """Call rate, error ratio, client latency quantiles and in-flight calls."""
    return "Overview", [
        _ts("RPC rate by method and mode",
            "Calls started per second by the selected workers, per function and call mode "
            "(rpc_sync, rpc_async, remote).", "reqps",
            _query(_sum_rate(REQUESTS, "method, mode"), "{{method}} {{mode}}"), width=6),
        _ts("Error ratio by method",
            "Share of the calls started by the selected workers that ended in an error "
            "(exception raised by the callee, timeout, connection error).", "percentunit",
            _query(f"({_sum_rate(CLIENT_ERRORS, 'method')} or 0 * {_sum_rate(REQUESTS, 'method')})"
                   f" / ({_sum_rate(REQUESTS, 'method')} > 0)", "{{method}}"),
            width=6),
        _ts("Client latency p50 / p95 / p99",
            "Duration seen by the caller, from the call until its result (or future) is ready. "
            "Click a point to open the traces at least that slow.", "s",
            _query(_quantile(0.5), "p50"),
            _query(_quantile(0.95), "p95"),
            _query(_quantile(0.99), "p99", exemplars=True),  # one query: each exemplar shows once
            width=6, links=_trace_links(by_method=False)),
        _ts("In-flight calls",
            "Calls started by the worker whose result has not arrived yet, per destination.", "short",
            _query(f"sum by (worker, dst) (torch_rpc_client_in_flight{{{JOB_WORKER}}})", "{{worker}} → {{dst}}"),
            width=6),
    ]


def _latency_row() -> _Row:
    """Client vs server latency per method, per calling and per serving worker, and serialization time."""
    client_mean = _mean(CLIENT_DURATION, "method")
    server_mean = _mean(SERVER_DURATION, "method", JOB_CALLEE_METHOD)
    return "Latency breakdown", [
        _ts("Client vs server latency p95 by method",
            "p95 of the caller's duration for the calls made by the selected workers, and of the "
            "run time of the same methods on every worker that serves them (the server histogram "
            "has no caller label, so that it does not grow with the number of peers).", "s",
            _query(_quantile(0.95, "le, method"), "client {{method}}", exemplars=True),
            _query(_quantile(0.95, "le, method", SERVER_DURATION, JOB_CALLEE_METHOD), "server {{method}}",
                   exemplars=True),
            links=_trace_links(by_method=True)),
        _ts("Mean duration: client, server and the difference",
            "Mean duration per call. The difference (client − server) is the time outside the "
            "remote function: serialization, transport and queueing for a free RPC thread.", "s",
            _query(client_mean, "client {{method}}"),
            _query(server_mean, "server {{method}}"),
            _query(f"{client_mean} - {server_mean}", "transport+queueing+serialization {{method}}"),
            links=_trace_links(by_method=True), min_zero=False),
        _ts("Client latency p95 by worker",
            "Caller-side p95 per calling worker. Click a point for that worker's slow traces.", "s",
            _query(_quantile(0.95, "le, worker"), "{{worker}}", exemplars=True),
            width=8, links=_trace_links(by_method=False, service=TRACE_SERVICE_FROM_SERIES)),
        _ts("Server run time p95 by worker",
            "Callee-side p95 of the remote functions each selected worker runs: one slow peer stands "
            "out here. Latency histograms carry no peer by default (series would grow with the world "
            "size); RPC_OBSERVE_PEER_LABELS=histograms adds dst and src to them for a per-peer view.", "s",
            _query(_quantile(0.95, "le, worker", SERVER_DURATION), "{{worker}}", exemplars=True),
            width=8, links=_trace_links(by_method=False, service=TRACE_SERVICE_FROM_SERIES)),
        _ts("Serialization time p95 by direction",
            "Time spent pickling (serialize) and unpickling (deserialize) RPC messages.", "s",
            _query(_quantile(0.95, "le, direction, message", "torch_rpc_serialization_seconds"),
                   "{{direction}} {{message}}"),
            width=8),
    ]


def _stuck_row() -> _Row:
    """The oldest call in flight and UDF running, idle threads, and each call's time: callee + outside."""
    from grafana_foundation_sdk.builders import barchart
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import dashboard as dm

    what_to_do = ("Above the workers' stuck threshold (RPC_OBSERVE_HANG_SECONDS, default 30 s: the red line) "
                  "rpc_observe's watchdog dumps the worker's calls and stacks into $RPC_OBSERVE_DIR/debug/; "
                  "run `rpc-observe doctor` to read them.")

    def age(title: str, description: str, metric: str) -> timeseries.Panel:
        return (_ts(title, f"{description} {what_to_do}", "s",
                    _query(f"max by (worker) ({metric}{{{JOB_WORKER}}})", "{{worker}}"),
                    _query(f"min(rpc_observe_hang_threshold_seconds{{{JOB_WORKER}}})", "stuck threshold"),
                    width=8)
                .thresholds(_thresholds((None, "transparent"), (STUCK_SECONDS, "red")))
                .thresholds_style(common_builders.GraphThresholdsStyleConfig()
                                  .mode(common.GraphThresholdsStyleMode.DASHED_AND_AREA)))

    split = ("The client's duration of each call is the callee's own time (from unpickling the "
             "request to pickling the response, as the callee reported it) plus the time outside "
             "it: queueing for a thread of the callee's pool, (de)serialization and the wire.")
    by_method_bars = (
        barchart.Panel().title("Mean time per call by method: callee + outside")
        .description(f"{split} Mean per call over the dashboard's time range, stacked: the whole bar "
                     "is the mean client duration of the calls whose callee reported its time.")
        .datasource(_prom_ds()).span(8).height(8).unit("s").min(0)
        .targets(_ref_ids([_query(_range_mean(CALLEE, "method"), "callee", instant=True, fmt="table"),
                           _query(_range_mean(OUTSIDE, "method"), "outside", instant=True, fmt="table")]))
        # One table per query (method, Value): merged on method into method | callee | outside.
        .transformations([
            dm.DataTransformerConfig(id_val="merge", options={}),
            dm.DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True},
                "renameByName": {"Value #A": "callee", "Value #B": "outside"}}),
        ])
        .x_field("method").stacking(common.StackingMode.NORMAL)
        .orientation(common.VizOrientation.HORIZONTAL).show_value(common.VisibilityMode.NEVER)
        .fill_opacity(80)
        .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM).show_legend(True))
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.NONE)))
    return "Stuck calls and where the time goes", [
        age("Oldest call in flight",
            "Age of the oldest RPC each worker started and has no result for yet (0 when none).",
            "torch_rpc_client_oldest_call_age_seconds"),
        age("Oldest UDF running",
            "Age of the oldest remote Python function each worker is running for a caller (0 when none).",
            "torch_rpc_server_oldest_udf_age_seconds"),
        _idle_threads_panel(),
        by_method_bars,
        (_ts("Mean time per call: callee + outside",
             f"{split} Mean per call over the selected workers and methods, stacked: the top is the "
             "mean client duration. Pick one method above for that method's split.", "s",
             _query(_mean(CALLEE, None), "callee"),
             _query(_mean(OUTSIDE, None), "outside"),
             width=8)
         .fill_opacity(60)
         .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))),
        _ts("Callee vs outside p50 by method",
            f"{split} Medians, per method: unlike the means, they do not add up to the client's median.",
            "s",
            _query(_quantile(0.5, "le, method", CALLEE), "callee {{method}}"),
            _query(_quantile(0.5, "le, method", OUTSIDE), "outside {{method}}"),
            width=8),
    ]


def _payload_row() -> _Row:
    """Serialized bytes and message sizes, tensors per message, and storage bytes sent outside tensors."""
    from grafana_foundation_sdk.builders import heatmap
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import heatmap as heatmap_models

    tensor_bytes = _sum_rate("torch_rpc_tensor_bytes_sum")
    storage_bytes = _sum_rate("torch_rpc_tensor_storage_bytes_sum")
    return "Payload", [
        _ts("Serialized bytes/s by direction",
            "Bytes of pickled RPC messages (requests and responses) per second.", "Bps",
            _query(_sum_rate("torch_rpc_serialized_bytes_sum", "direction"), "{{direction}}"),
            width=8),
        (heatmap.Panel().title("Bytes per message")
         .description("Distribution of serialized message sizes, from the histogram buckets.")
         .datasource(_prom_ds()).span(8).height(8)
         .targets(_ref_ids([_query(_sum_rate("torch_rpc_serialized_bytes_bucket", "le"), "{{le}}", fmt="heatmap")]))
         .calculate(False)
         .color(heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
                .scheme("Oranges").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
                .exponent(0.5).steps(64).reverse(False).fill("dark-orange"))
         .y_axis(heatmap.YAxisConfig().unit("bytes").reverse(False))
         .cell_gap(1)
         .mode(common.TooltipDisplayMode.SINGLE).show_y_histogram()
         .show_legend()),
        _ts("Tensors per message",
            "Mean number of tensors carried by a message.", "short",
            _query(_mean("torch_rpc_serialized_tensors", "direction, message"), "{{direction}} {{message}}"),
            width=8),
        _ts("Tensor bytes vs storage bytes",
            "Bytes of the tensors themselves vs bytes of the storages sent with them. A tensor "
            "that is a view of a larger storage sends the whole storage.", "Bps",
            _query(tensor_bytes, "tensor bytes"),
            _query(storage_bytes, "storage bytes"),
            width=16),
        (_stat("Wasted storage ratio",
               "1 − tensor bytes / storage bytes over the selected calls. Red above "
               f"{WASTED_STORAGE_RED:g}: most bytes sent are storage outside the tensors; "
               "send .clone() or .contiguous() copies of small views.", "percentunit", 1,
               _query(f"1 - {tensor_bytes} / ({storage_bytes} > 0)", "wasted"),
               red_from=WASTED_STORAGE_RED)
         .min(0).max(1)),
    ]


def _traffic_row() -> _Row:
    """Bytes and calls from each worker to each peer, and the responses' bytes back."""
    return "Traffic matrix", [
        _matrix_table("Bytes/s from worker to peer",
                      "Request bytes (pickled payload + tensor storages) each worker sends to "
                      "each destination. Rows: sending worker; columns: destination.", "Bps",
                      _sum_rate("torch_rpc_client_sent_bytes_total", "worker, dst", JOB_WORKER)),
        _matrix_table("Response bytes/s from peer to worker",
                      "Response bytes (pickled payload + tensor storages) each worker receives from each "
                      "peer it called, for the responses matched to their call. Rows: calling worker; "
                      "columns: the peer that answered.", "Bps",
                      _sum_rate("torch_rpc_client_received_bytes_total", "worker, dst", JOB_WORKER)),
        _matrix_table("Calls/s from worker to peer",
                      "Calls each worker starts to each destination. Rows: calling worker; "
                      "columns: destination.", "reqps",
                      _sum_rate(REQUESTS, "worker, dst")),
    ]


def _idle_threads_panel() -> timeseries.Panel:
    """Idle threads of each worker's RPC pool, red at 0 (in the Saturation and the stuck-calls rows)."""
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.models import common

    return (_ts("Idle RPC threads",
                "Idle threads of the RPC agent's pool. At 0 incoming calls queue up (red band; the "
                "dashboard annotation 'No idle RPC threads' marks those times).", "short",
                _query(f"sum by (worker) (torch_rpc_agent_idle_threads{{{JOB_WORKER}}})", "{{worker}}"),
                width=8)
            .thresholds(_thresholds((None, "red"), (1, "transparent")))
            .thresholds_style(common_builders.GraphThresholdsStyleConfig()
                              .mode(common.GraphThresholdsStyleMode.LINE_AND_AREA)))


def _saturation_row() -> _Row:
    """The RPC agent's thread pool, its busy workers, active calls and GIL wait."""
    return "Saturation", [
        _ts("RPC thread pool size", "Threads of the RPC agent's pool (TensorPipe num_worker_threads).", "short",
            _query(f"sum by (worker) (torch_rpc_agent_threads{{{JOB_WORKER}}})", "{{worker}}"),
            width=8),
        _idle_threads_panel(),
        _stat("Workers with no idle RPC thread",
              "Number of selected workers whose RPC thread pool is fully busy now.", "short", 0,
              _query(f"count({NO_IDLE_EXPR}) or vector(0)", "workers"),
              red_from=1),
        _ts("Active calls by side",
            "Calls the agent is working on: client (sent, awaiting a reply), server (running a "
            "remote function) and async (user functions returning futures).", "short",
            _query(f"sum by (worker, side) (torch_rpc_agent_active_calls{{{JOB_WORKER}}})", "{{worker}} {{side}}")),
        _ts("GIL wait", "Average time the RPC agent's threads wait for the GIL (reported when "
            "torch's RPC GIL profiling is on).", "s",
            _query(f"max by (worker) (torch_rpc_agent_gil_wait_seconds{{{JOB_WORKER}}})", "{{worker}}")),
    ]


def _state_row() -> _Row:
    """torch's own RPC state: RRefs and distributed autograd, where the leaks of RPC programs show."""

    def gauge(metric: str, title: str, description: str) -> timeseries.Panel:
        return _ts(title, description, "short",
                   _query(f"sum by (worker) ({metric}{{{JOB_WORKER}}})", "{{worker}}"), width=8)

    return "RPC state (torch)", [
        gauge("torch_rpc_rref_owners", "Owner RRefs (a steady rise is a leak)",
              "OwnerRRefs each worker holds: the values of remote() calls it ran. An owner RRef lives until "
              "every UserRRef of it is deleted; a count that rises steadily, step after step, is the classic "
              "leak of RPC programs (RRefs kept in a list, a cache or a reference cycle)."),
        gauge("torch_rpc_rref_pending_users", "Pending user RRefs",
              "UserRRefs created on the worker and not yet confirmed by their owner. High or growing: the "
              "owner is slow to answer or unreachable."),
        gauge("torch_rpc_rref_forks", "RRef forks",
              "RRefs this worker owns or passed on that it still tracks until the receiving worker confirms "
              "them. A steady rise: confirmations do not come back, and the owners' values stay alive."),
        gauge("torch_rpc_rref_pending_futures", "Pending RRef values",
              "OwnerRRefs whose value is not set yet: remote() calls still running on this worker."),
        gauge("torch_rpc_dist_autograd_contexts", "Distributed autograd contexts (a steady rise is a leak)",
              "Live distributed autograd contexts on each worker. Every `with dist_autograd.context()` frees "
              "its context on every worker it reached when it exits; a count that rises steadily is a leak "
              "(contexts never exited, or not released on a peer)."),
        gauge("torch_rpc_dist_autograd_backward_passes", "Distributed backward passes in progress",
              "dist_autograd.backward passes running on each worker."),
    ]


def _errors_row() -> _Row:
    """Client and server errors per second, and the client errors of the time range."""
    return "Errors", [
        _ts("Client errors/s by exception and method",
            "Failed calls seen by the caller, by exception class (or timeout / connection_error).", "reqps",
            _query(_sum_rate(CLIENT_ERRORS, "exception, method"), "{{exception}} {{method}}")),
        _ts("Server errors/s by exception and method",
            "Exceptions raised by remote functions running on the selected workers.", "reqps",
            _query(_sum_rate("torch_rpc_server_errors_total", "exception, method"), "{{exception}} {{method}}")),
        _table("Client errors in the time range",
               "Failed calls over the dashboard's time range, per caller, destination, method and exception.",
               "sum by (worker, dst, method, exception) "
               f"(increase({CLIENT_ERRORS}{{{JOB_WORKER_METHOD}}}[$__range])) > 0",
               ("organize", {"excludeByName": {"Time": True}, "renameByName": {"Value": "errors"}}),
               width=24, height=8, decimals=0),
    ]


def _health_row() -> _Row:
    """rpc_observe's own errors, dropped spans, and the workers Prometheus scrapes."""
    from grafana_foundation_sdk.models import common

    return "Add-on health", [
        _ts("Add-on internal errors/s",
            "Errors rpc_observe caught in its own code, by place. The RPC itself is unaffected; "
            "its telemetry may be incomplete.", "short",
            _query(_sum_rate("rpc_observe_internal_errors_total", "worker, where", JOB_WORKER), "{{worker}} {{where}}"),
            width=8),
        _ts("Dropped spans/s",
            "Spans rpc_observe dropped, by reason (export queue full, exporter failing, span files "
            "over their disk cap or not writable).", "short",
            _query(_sum_rate("rpc_observe_spans_dropped_total", "worker, reason", JOB_WORKER),
                   "{{worker}} {{reason}}"),
            width=8),
        (_stat("Workers scraped",
               "Workers whose metrics endpoint Prometheus scraped successfully / all "
               "workers listed in the run directory's targets/.", "short", 0,
               _query(f"sum(up{{{JOB_WORKER}}})", "up"),
               _query(f"count(up{{{JOB_WORKER}}})", "targets"))
         .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
         .color_mode(common.BigValueColorMode.NONE)
         .graph_mode(common.BigValueGraphMode.NONE)),
    ]


def build_dashboard() -> dm.Dashboard:
    """Return the dashboard model: its settings, variables and annotation, then each row and its panels."""
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.models import dashboard as dm

    builder = (
        dash.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description("torch.distributed.rpc seen through rpc_observe: call rates, latency "
                     "breakdown, stuck calls and where each call's time goes, payloads, traffic "
                     "between workers, saturation, RRef and autograd state, errors.")
        .tags(["rpc_observe", "pytorch", "generated"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .link(dash.DashboardLink("Jaeger UI").type(dm.DashboardLinkType.LINK)
              .url(JAEGER_UI_URL).target_blank(True).icon("external link").tooltip(
                  "Trace search").tags([]).as_dropdown(False).include_vars(False)
              .keep_time(False))
        .variables(_variables())
        .annotation(_no_idle_annotation())
    )
    for title, panels in (_overview_row(), _latency_row(), _stuck_row(), _payload_row(), _traffic_row(),
                          _saturation_row(), _state_row(), _errors_row(), _health_row()):
        builder = builder.with_row(dash.Row(title))
        for panel in panels:
            builder = builder.with_panel(panel)
    model = builder.build()
    # Panel ids: unique, in reading order (rows included).
    for panel_id, built in enumerate(model.panels or (), start=1):
        built.id_val = panel_id
    return model


def render() -> str:
    """The dashboard as the exact text committed in ``rpc_observe.json``."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    encoder = JSONEncoder(sort_keys=True, indent=2, ensure_ascii=False)
    return encoder.encode(build_dashboard()) + "\n"


def installed_sdk_version() -> str | None:
    """The installed version of the SDK's distribution, or ``None`` if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(SDK_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    """Write the dashboard JSON, or with ``--check`` compare it; 1 if stale, 2 if the SDK version is wrong."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the committed JSON differs")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)

    version = installed_sdk_version()
    if version != SDK_VERSION:
        print(f"need {SDK_REQUIREMENT!r} (installed: {version}); the output depends on it",
              file=sys.stderr)
        return 2
    text = render()
    undeclared = undeclared_metrics(text)
    if undeclared:
        print(f"the dashboard queries metrics rpc_observe does not declare (rpc_observe/telemetry/declarations.py): "
              f"{', '.join(undeclared)}", file=sys.stderr)
        return 1
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(f"{args.output} is stale: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
