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

Besides the generator this module offers two helpers that need no SDK, for
tests that run the panels' PromQL against a real Prometheus:

* ``panel_queries(dashboard_json)`` -> ``[(panel_title, expr), ...]``
* ``annotation_queries(dashboard_json)`` and ``variable_selectors(dashboard_json)``
  for the annotation queries and the series selectors of the variables
* ``substitute_variables(expr, ...)`` -> plain PromQL with ``$job``,
  ``$worker``, ``$method``, ``$__rate_interval``, ``$__interval``,
  ``$__range`` (and their ``${...}`` forms) replaced.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

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

ALL_VALUE = ".*"

# Label filters.  Every query is filtered by job and worker; metrics that carry
# a `method` label are filtered by method too.
JOB_WORKER = 'job=~"$job", worker=~"$worker"'
JOB_WORKER_METHOD = 'job=~"$job", worker=~"$worker", method=~"$method"'
# Server-side series paired with client-side ones (latency breakdown): the
# calls *made by* the selected workers are those whose `src` is selected.
JOB_SRC_METHOD = 'job=~"$job", src=~"$worker", method=~"$method"'

RPC_METRICS_SELECTOR = '{__name__=~"torch_rpc_.+|rpc_observe_.+"'


# --------------------------------------------------------------------------
# Helpers that need no SDK
# --------------------------------------------------------------------------


def _walk_panels(panels: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
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
    if isinstance(dashboard_json, str):
        dashboard_json = json.loads(dashboard_json)
    out: list[tuple[str, str]] = []
    for panel in _walk_panels(dashboard_json.get("panels") or ()):
        for target in panel.get("targets") or ():
            expr = target.get("expr")
            if expr:
                out.append((panel.get("title", ""), expr))
    return out


def annotation_queries(dashboard_json: Mapping[str, Any] | str) -> list[tuple[str, str]]:
    """Return ``(annotation_name, expr)`` for every Prometheus annotation query."""
    if isinstance(dashboard_json, str):
        dashboard_json = json.loads(dashboard_json)
    out: list[tuple[str, str]] = []
    for annotation in (dashboard_json.get("annotations") or {}).get("list") or ():
        expr = annotation.get("expr") or (annotation.get("target") or {}).get("expr")
        if expr:
            out.append((annotation.get("name", ""), expr))
    return out


_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.*),\s*(?P<label>\w+)\)", re.DOTALL)


def variable_selectors(dashboard_json: Mapping[str, Any] | str) -> list[tuple[str, str, str]]:
    """Return ``(variable_name, series_selector, label)`` for each ``label_values`` variable.

    The selector is PromQL (after ``substitute_variables``), e.g. for
    ``/api/v1/series?match[]=...``.
    """
    if isinstance(dashboard_json, str):
        dashboard_json = json.loads(dashboard_json)
    out: list[tuple[str, str, str]] = []
    for variable in (dashboard_json.get("templating") or {}).get("list") or ():
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
        name = match.group("braced") or match.group("bare") or match.group("old")
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


# --------------------------------------------------------------------------
# The dashboard
# --------------------------------------------------------------------------


def _sdk():
    """Import the SDK lazily, so that the helpers above work without it."""
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import heatmap as heatmap_models

    return (common_builders, dash, heatmap, prometheus, stat, table, timeseries,
            cogbuilder, JSONEncoder, common, dm, heatmap_models)


def build_dashboard():
    """Return the dashboard model (``grafana_foundation_sdk.models.dashboard.Dashboard``)."""
    (common_builders, dash, heatmap, prometheus, stat, table, timeseries,
     cogbuilder, JSONEncoder, common, dm, heatmap_models) = _sdk()

    prom_ds = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

    # -- small extensions of the SDK's models ------------------------------

    class _DataLink(dm.DashboardLink):
        """A field data link: an external URL, or an internal link to Explore."""

        def __init__(self, title: str, url: str = "", internal: dict | None = None) -> None:
            super().__init__(title=title, url=url, target_blank=not internal)
            self.internal = internal

        def to_json(self) -> dict[str, object]:
            payload: dict[str, object] = {"title": self.title, "url": self.url or ""}
            if self.internal is not None:
                payload["internal"] = self.internal
            else:
                payload["targetBlank"] = self.target_blank
            return payload

    class DataLink(cogbuilder.Builder[dm.DashboardLink]):
        def __init__(self, title: str, url: str = "", internal: dict | None = None) -> None:
            self._internal = _DataLink(title, url, internal)

        def build(self) -> dm.DashboardLink:
            return self._internal

    class _PromAnnotation(dm.AnnotationQuery):
        """A Prometheus annotation query with the fields Grafana's editor sets."""

        def __init__(self, title_format: str, tag_keys: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.title_format = title_format
            self.tag_keys = tag_keys

        def to_json(self) -> dict[str, object]:
            payload = super().to_json()
            payload.update({
                "titleFormat": self.title_format,
                "tagKeys": self.tag_keys,
                "textFormat": "",
                "step": "",
                "useValueForTime": False,
            })
            return payload

    class PromAnnotation(cogbuilder.Builder[dm.AnnotationQuery]):
        def __init__(self, **kwargs: Any) -> None:
            self._internal = _PromAnnotation(**kwargs)

        def build(self) -> dm.AnnotationQuery:
            return self._internal

    # -- building blocks ---------------------------------------------------

    def query(expr: str, legend: str = "__auto", ref: str = "A", *, instant: bool = False,
              fmt: str | None = None):
        q = (prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
             .datasource(prom_ds))
        q = q.instant() if instant else q.range()
        if fmt == "table":
            from grafana_foundation_sdk.models.prometheus import PromQueryFormat
            q = q.format(PromQueryFormat.TABLE)
        elif fmt == "heatmap":
            from grafana_foundation_sdk.models.prometheus import PromQueryFormat
            q = q.format(PromQueryFormat.HEATMAP)
        return q

    def thresholds(*steps: tuple[float | None, str]):
        return (dash.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE)
                .steps([dm.Threshold(value=v, color=c) for v, c in steps]))

    def legend_table():
        return (common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM).show_legend(True)
                .calcs(["mean", "max", "lastNotNull"]))

    def ts(title: str, description: str, unit: str, *targets, width: int = 12, height: int = 8,
           links=None, min_zero: bool = True):
        """A time series panel with a table legend and a shared, sorted tooltip."""
        panel = (timeseries.Panel().title(title).description(description)
                 .datasource(prom_ds).unit(unit).span(width).height(height)
                 .line_width(1).fill_opacity(10).show_points(common.VisibilityMode.NEVER)
                 .legend(legend_table())
                 .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                          .sort(common.SortOrder.DESCENDING)))
        if min_zero:
            panel = panel.min(0)
        for target in targets:
            panel = panel.with_target(target)
        if links:
            panel = panel.data_links(links)
        return panel

    def row(title: str):
        return dash.Row(title)

    def trace_links(by_method: bool, service: str = TRACE_SERVICE_FROM_VARIABLE) -> list:
        """Links from a latency point to traces at least that slow.

        ``${__value.raw}`` is the clicked latency in seconds, a valid Go
        duration with an "s" appended, which is what Jaeger's minDuration takes.
        Jaeger's search needs a service: ``service`` is the series' worker or
        the ``trace_service`` variable.
        """
        tags_url = ""
        tags_query = ""
        if by_method:
            # {"rpc.method":"<method>"}, URL-encoded around the (Grafana-encoded) value.
            tags_url = (f"&tags=%7B%22{TRACE_METHOD_ATTRIBUTE}%22%3A%22"
                        "${__field.labels.method}%22%7D")
            tags_query = f'{TRACE_METHOD_ATTRIBUTE}="${{__field.labels.method}}"'
        jaeger_url = (f"{JAEGER_UI_URL}/search?service={service}{tags_url}"
                      "&minDuration=${__value.raw}s&lookback=custom"
                      "&start=${__from}000&end=${__to}000&limit=20")
        explore_query = {
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
                     internal={"datasourceUid": JAEGER_UID, "datasourceName": JAEGER_NAME,
                               "query": explore_query}),
        ]

    # -- variables -----------------------------------------------------------

    def query_variable(name: str, label: str, definition: str):
        return (dash.QueryVariable(name).label(label).datasource(prom_ds).query(definition)
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dm.VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(ALL_VALUE)
                .current(dm.VariableOption(text=["All"], value=["$__all"], selected=True)))

    variables = [
        (dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
         .current(dm.VariableOption(text=PROMETHEUS_NAME, value=PROMETHEUS_UID, selected=True))),
        query_variable("job", "Job", f"label_values({RPC_METRICS_SELECTOR}}}, job)"),
        query_variable("worker", "Worker",
                       f'label_values({RPC_METRICS_SELECTOR}, job=~"$job"}}, worker)'),
        query_variable(
            "method", "Method",
            'label_values({__name__=~"torch_rpc_client_requests_total|'
            'torch_rpc_server_duration_seconds_count|torch_rpc_serialized_bytes_count", '
            'job=~"$job", worker=~"$worker"}, method)'),
        (dash.QueryVariable("trace_service").label("Trace service")
         .description("service.name whose traces the latency panels link to: rpc_observe names "
                      "spans after the worker, unless the job sets OTEL_SERVICE_NAME (type it)")
         .datasource(prom_ds)
         .query(f'label_values({RPC_METRICS_SELECTOR}, job=~"$job", worker=~"$worker"}}, worker)')
         .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
         .sort(dm.VariableSort.ALPHABETICAL_ASC)
         .multi(False).include_all(False).allow_custom_value(True)),
    ]

    # -- annotations ---------------------------------------------------------

    no_idle_expr = f"min by (job, worker) (torch_rpc_agent_idle_threads{{{JOB_WORKER}}}) == 0"
    annotations = [
        PromAnnotation(
            name="No idle RPC threads", datasource=prom_ds, enable=True, hide=False,
            icon_color="red", expr=no_idle_expr,
            title_format="No idle RPC threads on {{worker}}", tag_keys="worker"),
    ]

    # -- rows and panels -----------------------------------------------------

    def client_quantile(q: float, by: str = "le") -> str:
        return (f"histogram_quantile({q}, sum by ({by}) (rate(torch_rpc_client_duration_seconds_bucket"
                f"{{{JOB_WORKER_METHOD}}}[$__rate_interval])))")

    def server_quantile(q: float, by: str = "le") -> str:
        return (f"histogram_quantile({q}, sum by ({by}) (rate(torch_rpc_server_duration_seconds_bucket"
                f"{{{JOB_SRC_METHOD}}}[$__rate_interval])))")

    def mean(metric: str, selector: str, by: str) -> str:
        return (f"sum by ({by}) (rate({metric}_sum{{{selector}}}[$__rate_interval]))"
                f" / (sum by ({by}) (rate({metric}_count{{{selector}}}[$__rate_interval])) > 0)")

    requests = f"rate(torch_rpc_client_requests_total{{{JOB_WORKER_METHOD}}}[$__rate_interval])"
    client_errors = f"rate(torch_rpc_client_errors_total{{{JOB_WORKER_METHOD}}}[$__rate_interval])"

    overview = [
        ts("RPC rate by method and mode",
           "Calls started per second by the selected workers, per function and call mode "
           "(rpc_sync, rpc_async, remote).", "reqps",
           query(f"sum by (method, mode) ({requests})", "{{method}} {{mode}}"), width=6),
        ts("Error ratio by method",
           "Share of the calls started by the selected workers that ended in an error "
           "(exception raised by the callee, timeout, connection error).", "percentunit",
           query(f"(sum by (method) ({client_errors}) or 0 * sum by (method) ({requests}))"
                 f" / (sum by (method) ({requests}) > 0)", "{{method}}"),
           width=6),
        ts("Client latency p50 / p95 / p99",
           "Duration seen by the caller, from the call until its result (or future) is ready. "
           "Click a point to open the traces at least that slow.", "s",
           query(client_quantile(0.5), "p50", "A"),
           query(client_quantile(0.95), "p95", "B"),
           query(client_quantile(0.99), "p99", "C"),
           width=6, links=trace_links(by_method=False)),
        ts("In-flight calls",
           "Calls started by the worker whose result has not arrived yet, per destination.",
           "short",
           query(f"sum by (worker, dst) (torch_rpc_client_in_flight{{{JOB_WORKER}}})",
                 "{{worker}} → {{dst}}"),
           width=6),
    ]

    latency = [
        ts("Client vs server latency p95 by method",
           "p95 of the caller's duration and of the callee's run time for the calls made by the "
           "selected workers (server series are matched on src = worker).", "s",
           query(client_quantile(0.95, "le, method"), "client {{method}}", "A"),
           query(server_quantile(0.95, "le, method"), "server {{method}}", "B"),
           links=trace_links(by_method=True)),
        ts("Mean duration: client, server and the difference",
           "Mean duration per call. The difference (client − server) is the time outside the "
           "remote function: serialization, transport and queueing for a free RPC thread.", "s",
           query(mean("torch_rpc_client_duration_seconds", JOB_WORKER_METHOD, "method"),
                 "client {{method}}", "A"),
           query(mean("torch_rpc_server_duration_seconds", JOB_SRC_METHOD, "method"),
                 "server {{method}}", "B"),
           query(f"{mean('torch_rpc_client_duration_seconds', JOB_WORKER_METHOD, 'method')}"
                 f" - {mean('torch_rpc_server_duration_seconds', JOB_SRC_METHOD, 'method')}",
                 "transport+queueing+serialization {{method}}", "C"),
           links=trace_links(by_method=True), min_zero=False),
        ts("Client latency p95 by worker",
           "Caller-side p95 per calling worker. Click a point for that worker's slow traces.", "s",
           query(client_quantile(0.95, "le, worker"), "{{worker}}"),
           width=8, links=trace_links(by_method=False, service=TRACE_SERVICE_FROM_SERIES)),
        ts("Client latency p95 by destination",
           "Caller-side p95 per peer: one slow peer stands out here.", "s",
           query(client_quantile(0.95, "le, dst"), "{{dst}}"),
           width=8, links=trace_links(by_method=False)),
        ts("Serialization time p95 by direction",
           "Time spent pickling (serialize) and unpickling (deserialize) RPC messages.", "s",
           query("histogram_quantile(0.95, sum by (le, direction, message) "
                 f"(rate(torch_rpc_serialization_seconds_bucket{{{JOB_WORKER_METHOD}}}"
                 "[$__rate_interval])))", "{{direction}} {{message}}"),
           width=8),
    ]

    def payload_sum_rate(metric: str, by: str | None = None) -> str:
        inner = f"rate({metric}_sum{{{JOB_WORKER_METHOD}}}[$__rate_interval])"
        return f"sum by ({by}) ({inner})" if by else f"sum({inner})"

    wasted_expr = (f"1 - {payload_sum_rate('torch_rpc_tensor_bytes')}"
                   f" / ({payload_sum_rate('torch_rpc_tensor_storage_bytes')} > 0)")

    payload = [
        ts("Serialized bytes/s by direction",
           "Bytes of pickled RPC messages (requests and responses) per second.", "Bps",
           query(payload_sum_rate("torch_rpc_serialized_bytes", "direction"), "{{direction}}"),
           width=8),
        (heatmap.Panel().title("Bytes per message")
         .description("Distribution of serialized message sizes, from the histogram buckets.")
         .datasource(prom_ds).span(8).height(8)
         .with_target(query(f"sum by (le) (rate(torch_rpc_serialized_bytes_bucket{{{JOB_WORKER_METHOD}}}"
                            "[$__rate_interval]))", "{{le}}", fmt="heatmap"))
         .calculate(False)
         .color(heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
                .scheme("Oranges").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
                .exponent(0.5).steps(64).reverse(False).fill("dark-orange"))
         .y_axis(heatmap.YAxisConfig().unit("bytes").reverse(False))
         .cell_gap(1)
         .mode(common.TooltipDisplayMode.SINGLE).show_y_histogram()
         .show_legend()),
        ts("Tensors per message",
           "Mean number of tensors carried by a message.", "short",
           query(mean("torch_rpc_serialized_tensors", JOB_WORKER_METHOD, "direction, message"),
                 "{{direction}} {{message}}"),
           width=8),
        ts("Tensor bytes vs storage bytes",
           "Bytes of the tensors themselves vs bytes of the storages sent with them. A tensor "
           "that is a view of a larger storage sends the whole storage.", "Bps",
           query(payload_sum_rate("torch_rpc_tensor_bytes"), "tensor bytes", "A"),
           query(payload_sum_rate("torch_rpc_tensor_storage_bytes"), "storage bytes", "B"),
           width=16),
        (stat.Panel().title("Wasted storage ratio")
         .description("1 − tensor bytes / storage bytes over the selected calls. Red above "
                      f"{WASTED_STORAGE_RED:g}: most bytes sent are storage outside the tensors; "
                      "send .clone() or .contiguous() copies of small views.")
         .datasource(prom_ds).span(8).height(8).unit("percentunit").decimals(1).min(0).max(1)
         .with_target(query(wasted_expr, "wasted"))
         .thresholds(thresholds((None, "green"), (WASTED_STORAGE_RED, "red")))
         .color_scheme(dash.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
         .color_mode(common.BigValueColorMode.BACKGROUND)
         .graph_mode(common.BigValueGraphMode.AREA)
         .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))),
    ]

    def matrix_table(title: str, description: str, unit: str, expr: str):
        return (table.Panel().title(title).description(description)
                .datasource(prom_ds).span(12).height(9).unit(unit).decimals(2)
                .with_target(query(expr, "", instant=True, fmt="table"))
                .with_transformation(dm.DataTransformerConfig(
                    id_val="groupingToMatrix",
                    options={"rowField": "worker", "columnField": "dst", "valueField": "Value",
                             "emptyValue": "zero"}))
                .with_transformation(dm.DataTransformerConfig(
                    id_val="organize",
                    options={"renameByName": {"worker\\dst": "worker → dst"}})))

    traffic = [
        matrix_table("Bytes/s from worker to peer",
                     "Request bytes (pickled payload + tensor storages) each worker sends to "
                     "each destination. Rows: sending worker; columns: destination.", "Bps",
                     f"sum by (worker, dst) (rate(torch_rpc_client_sent_bytes_total{{{JOB_WORKER}}}"
                     "[$__rate_interval]))"),
        matrix_table("Calls/s from worker to peer",
                     "Calls each worker starts to each destination. Rows: calling worker; "
                     "columns: destination.", "reqps",
                     f"sum by (worker, dst) ({requests})"),
    ]

    idle_threshold_style = common_builders.GraphThresholdsStyleConfig().mode(
        common.GraphThresholdsStyleMode.LINE_AND_AREA)
    saturation = [
        ts("RPC thread pool size", "Threads of the RPC agent's pool (TensorPipe num_worker_threads).",
           "short",
           query(f"sum by (worker) (torch_rpc_agent_threads{{{JOB_WORKER}}})", "{{worker}}"),
           width=8),
        (ts("Idle RPC threads",
            "Idle threads of the RPC agent's pool. At 0 incoming calls queue up (red band; the "
            "dashboard annotation 'No idle RPC threads' marks those times).", "short",
            query(f"sum by (worker) (torch_rpc_agent_idle_threads{{{JOB_WORKER}}})", "{{worker}}"),
            width=8)
         .thresholds(thresholds((None, "red"), (1, "transparent")))
         .thresholds_style(idle_threshold_style)),
        (stat.Panel().title("Workers with no idle RPC thread")
         .description("Number of selected workers whose RPC thread pool is fully busy now.")
         .datasource(prom_ds).span(8).height(8).unit("short").decimals(0)
         .with_target(query(f"count({no_idle_expr}) or vector(0)", "workers"))
         .thresholds(thresholds((None, "green"), (1, "red")))
         .color_scheme(dash.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
         .color_mode(common.BigValueColorMode.BACKGROUND)
         .graph_mode(common.BigValueGraphMode.AREA)
         .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))),
        ts("Active calls by side",
           "Calls the agent is working on: client (sent, awaiting a reply), server (running a "
           "remote function) and async (user functions returning futures).", "short",
           query(f"sum by (worker, side) (torch_rpc_agent_active_calls{{{JOB_WORKER}}})",
                 "{{worker}} {{side}}")),
        ts("GIL wait", "Average time the RPC agent's threads wait for the GIL (reported when "
           "torch's RPC GIL profiling is on).", "s",
           query(f"max by (worker) (torch_rpc_agent_gil_wait_seconds{{{JOB_WORKER}}})",
                 "{{worker}}")),
    ]

    errors = [
        ts("Client errors/s by exception and method",
           "Failed calls seen by the caller, by exception class (or timeout / connection_error).",
           "reqps",
           query(f"sum by (exception, method) ({client_errors})", "{{exception}} {{method}}")),
        ts("Server errors/s by exception and method",
           "Exceptions raised by remote functions running on the selected workers.", "reqps",
           query("sum by (exception, method) (rate(torch_rpc_server_errors_total"
                 f"{{{JOB_WORKER_METHOD}}}[$__rate_interval]))", "{{exception}} {{method}}")),
        (table.Panel().title("Client errors in the time range")
         .description("Failed calls over the dashboard's time range, per caller, destination, "
                      "method and exception.")
         .datasource(prom_ds).span(24).height(8).decimals(0)
         .with_target(query("sum by (worker, dst, method, exception) (increase("
                            f"torch_rpc_client_errors_total{{{JOB_WORKER_METHOD}}}[$__range])) > 0",
                            "", instant=True, fmt="table"))
         .with_transformation(dm.DataTransformerConfig(
             id_val="organize",
             options={"excludeByName": {"Time": True},
                      "renameByName": {"Value": "errors"}}))),
    ]

    health = [
        ts("Add-on internal errors/s",
           "Errors rpc_observe caught in its own code, by place. The RPC itself is unaffected; "
           "its telemetry may be incomplete.", "short",
           query("sum by (worker, where) (rate(rpc_observe_internal_errors_total"
                 f"{{{JOB_WORKER}}}[$__rate_interval]))", "{{worker}} {{where}}"),
           width=8),
        ts("Dropped spans/s",
           "Spans rpc_observe dropped (export queue full or exporter failing).", "short",
           query("sum by (worker) (rate(rpc_observe_spans_dropped_total"
                 f"{{{JOB_WORKER}}}[$__rate_interval]))", "{{worker}}"),
           width=8),
        (stat.Panel().title("Workers scraped")
         .description("Workers whose metrics endpoint Prometheus scraped successfully / all "
                      "workers listed in the run directory's targets/.")
         .datasource(prom_ds).span(8).height(8).unit("short").decimals(0)
         .with_target(query(f"sum(up{{{JOB_WORKER}}})", "up", "A"))
         .with_target(query(f"count(up{{{JOB_WORKER}}})", "targets", "B"))
         .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
         .color_mode(common.BigValueColorMode.NONE)
         .graph_mode(common.BigValueGraphMode.NONE)
         .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))),
    ]

    builder = (
        dash.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description("torch.distributed.rpc seen through rpc_observe: call rates, latency "
                     "breakdown, payloads, traffic between workers, saturation, errors.")
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
    )
    for variable in variables:
        builder = builder.with_variable(variable)
    for annotation in annotations:
        builder = builder.annotation(annotation)
    for title, panels in [
        ("Overview", overview),
        ("Latency breakdown", latency),
        ("Payload", payload),
        ("Traffic matrix", traffic),
        ("Saturation", saturation),
        ("Errors", errors),
        ("Add-on health", health),
    ]:
        builder = builder.with_row(row(title))
        for panel in panels:
            builder = builder.with_panel(panel)
    model = builder.build()
    # Panel ids: unique, in reading order (rows included).
    for panel_id, panel in enumerate(model.panels, start=1):
        panel.id_val = panel_id
    return model


def render() -> str:
    """The dashboard as the exact text committed in ``rpc_observe.json``."""
    JSONEncoder = _sdk()[8]
    encoder = JSONEncoder(sort_keys=True, indent=2, ensure_ascii=False)
    return encoder.encode(build_dashboard()) + "\n"


def installed_sdk_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version(SDK_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
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
