"""Every environment variable rpc_observe reads, parsed and validated in one place.

Bad values never stop the job: each gives one warning that names the variable and
what it accepts, and the documented default is used instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

_logger = logging.getLogger("rpc_observe")

# Names of the variables, documented in docs/configuration.md.
RPC_OBSERVE = "RPC_OBSERVE"
RPC_OBSERVE_DIR = "RPC_OBSERVE_DIR"
RPC_OBSERVE_RUN_ID = "RPC_OBSERVE_RUN_ID"
RPC_OBSERVE_METRICS = "RPC_OBSERVE_METRICS"
RPC_OBSERVE_METRICS_PORT = "RPC_OBSERVE_METRICS_PORT"
RPC_OBSERVE_METRICS_ADDR = "RPC_OBSERVE_METRICS_ADDR"
RPC_OBSERVE_METRICS_ADVERTISE_ADDR = "RPC_OBSERVE_METRICS_ADVERTISE_ADDR"
RPC_OBSERVE_MAX_METHODS = "RPC_OBSERVE_MAX_METHODS"
RPC_OBSERVE_MAX_PEERS = "RPC_OBSERVE_MAX_PEERS"
RPC_OBSERVE_PEER_LABELS = "RPC_OBSERVE_PEER_LABELS"
RPC_OBSERVE_PROFILER_EVENTS = "RPC_OBSERVE_PROFILER_EVENTS"
RPC_OBSERVE_PROFILE = "RPC_OBSERVE_PROFILE"
RPC_OBSERVE_PROFILE_MAX_SECONDS = "RPC_OBSERVE_PROFILE_MAX_SECONDS"
RPC_OBSERVE_SPAN_NAMES = "RPC_OBSERVE_SPAN_NAMES"
RPC_OBSERVE_MAX_EXCEPTION_MESSAGE = "RPC_OBSERVE_MAX_EXCEPTION_MESSAGE"
RPC_OBSERVE_SIGNALS = "RPC_OBSERVE_SIGNALS"
RPC_OBSERVE_GIL_PROFILING = "RPC_OBSERVE_GIL_PROFILING"
RPC_OBSERVE_SPANS_MAX_BYTES = "RPC_OBSERVE_SPANS_MAX_BYTES"
RPC_OBSERVE_SPANS_FILE_BYTES = "RPC_OBSERVE_SPANS_FILE_BYTES"
RPC_OBSERVE_RECORDER_SIZE = "RPC_OBSERVE_RECORDER_SIZE"
RPC_OBSERVE_HANG_SECONDS = "RPC_OBSERVE_HANG_SECONDS"
RPC_OBSERVE_KEEP_THREAD_STATES = "RPC_OBSERVE_KEEP_THREAD_STATES"
# Half torch's default 60 s RPC timeout: the watchdog dumps before torch's timeout clears the evidence.
DEFAULT_HANG_SECONDS = 30.0

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_TRACES_EXPORTERS = ("file", "otlp", "console", "none")
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
    "rpc_observe_ratelimit",  # ours: OTEL_TRACES_SAMPLER_ARG new traces per second per worker
    "parentbased_rpc_observe_ratelimit",
)
_OTLP_PROTOCOLS = ("http/protobuf", "grpc")
_METRICS_EXPORTERS = ("prometheus", "otlp", "none")
_PEER_LABELS = ("counters", "histograms")


@dataclasses.dataclass(frozen=True)
class Config:
    """The validated settings of one process."""

    out_dir: str = "rpc_observe_out"
    run_id: str = ""
    metrics: bool = True
    metrics_port: int | None = None  # base port; None: the OS picks one
    metrics_addr: str = "127.0.0.1"
    metrics_advertise_addr: str = ""  # the host in the file_sd target; empty: from metrics_addr
    max_methods: int = 100
    max_peers: int = 256  # distinct peer (dst, src) label values; the rest are "other"
    peer_labels: str = "counters"  # "counters": peers on the per-peer counters only; "histograms": also on latency
    profiler_events: bool = True
    profile: bool = False
    profile_max_seconds: float = 300.0
    span_names: str = "key"  # "key": torch's profiling key; "method": {rpc.method}
    max_exception_message: int = 256
    signals: bool = True  # flush on SIGTERM (telemetry/signals.py)
    gil_profiling: bool = False  # torch's rpc.enable_gil_profiling(True) after init_rpc
    traces_exporters: tuple[str, ...] = ("file",)
    otlp_protocol: str = "http/protobuf"
    sampler: str = "parentbased_always_on"
    sampler_ratio: float = 1.0
    sampler_rate: float = 10.0  # new traces per second per worker, for the rpc_observe_ratelimit samplers
    spans_max_bytes: int = 1 << 30  # all span files of one process; 0: no cap
    spans_file_bytes: int = 64 << 20  # a span file is rotated before it would grow past this
    propagators: tuple[str, ...] = ("tracecontext", "baggage")
    service_name: str = ""
    bsp_schedule_delay_s: float = 1.0
    bsp_max_queue_size: int = 16384
    bsp_max_export_batch_size: int = 2048
    bsp_export_timeout_s: float = 5.0
    recorder_size: int = 1000  # the flight recorder's last finished calls; 0: none kept
    # A call in flight or a UDF running longer than this is dumped by the watchdog. 0: off.
    hang_seconds: float = DEFAULT_HANG_SECONDS
    log_correlation: bool = True  # trace ids in logging records (hooks/log_correlation.py)
    keep_thread_states: bool = True  # torch's pool threads keep their Python thread state (hooks/thread_states.py)
    # The C modules (hooks/_core.c, hooks/_stacks.c, telemetry/_spanjson.c) where built; RPC_OBSERVE_NO_EXTENSIONS=1:
    # their Python references. The hooks' are read where they load (hooks/native.py); the span file exporter's
    # from here (exporters.build_sinks).
    extensions: bool = True
    metrics_exporters: tuple[str, ...] = ("prometheus",)  # "otlp": also pushed (telemetry/otlp_metrics.py)
    metric_export_interval_s: float = 60.0
    otlp_metrics_endpoint: str = "http://localhost:4318/v1/metrics"
    otlp_metrics_headers: tuple[tuple[str, str], ...] = ()
    otlp_metrics_timeout_s: float = 10.0

    @property
    def tracing(self) -> bool:
        return bool(self.traces_exporters)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether RPC_OBSERVE asks for instrumentation; warns once on a value it does not know."""
    value = (os.environ if environ is None else environ).get(RPC_OBSERVE, "").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        _warn(RPC_OBSERVE, value, "1/true/yes/on to enable, 0/false/no/off or unset to disable; staying off")
    return False


def _warn(name: str, value: str, accepted: str) -> None:
    _logger.warning("rpc_observe: %s=%r is not valid: accepted %s.", name, value, accepted)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or not value.strip():  # empty is unset, as OpenTelemetry's variables
        return default
    value = value.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    _warn(name, value, f"1/true/yes/on or 0/false/no/off; using {int(default)}")
    return default


def _number(env: Mapping[str, str], name: str, default: Any, low: float, high: float, kind: type = int,
            scale: float = 1) -> Any:
    """A number in [low, high]; `scale` converts the variable's unit (ms) to ours (s)."""
    value = env.get(name)
    number = None
    if value is not None and value.strip() != "":
        try:
            number = kind(value.strip())
        except ValueError:
            pass
        if number is None or not (low <= number <= high):
            shown = "the OS's choice" if default is None else default
            _warn(name, value, f"a {kind.__name__} from {low} to {high}; using {shown}")
            number = None
    if number is None:
        number = default
    return number / scale if number is not None and scale != 1 else number


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str, accepted: str,
            lower: bool = True) -> str:
    """One of `allowed` (`accepted` says what they mean, in the warning), else `default`."""
    value = (env.get(name) or default).strip()
    value = value.lower() if lower else value
    if value in allowed:
        return value
    _warn(name, value, f"{accepted}; using {default}")
    return default


def _choices(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    items = tuple(dict.fromkeys(v.strip().lower() for v in value.split(",") if v.strip()))
    unknown = [v for v in items if v not in allowed]
    if unknown:
        _warn(name, value, f"a comma-separated list of {', '.join(allowed)}; ignoring {', '.join(unknown)}")
        items = tuple(v for v in items if v in allowed) or default
    return items


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Reads every rpc_observe and OTEL_* variable once and returns a frozen Config."""
    env = os.environ if environ is None else environ
    metrics_exporters = _choices(env, "OTEL_METRICS_EXPORTER", _METRICS_EXPORTERS, ("prometheus",))
    metrics_exporters = () if "none" in metrics_exporters else metrics_exporters
    exporters = _choices(env, "OTEL_TRACES_EXPORTER", _TRACES_EXPORTERS, ("file",))
    if "none" in exporters:
        exporters = ()
    protocol_variable = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                              if env.get(v)), "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = _choice(env, protocol_variable, _OTLP_PROTOCOLS, "http/protobuf", " or ".join(_OTLP_PROTOCOLS),
                       lower=False)
    sampler = _choice(env, "OTEL_TRACES_SAMPLER", _SAMPLERS, "parentbased_always_on", f"one of {', '.join(_SAMPLERS)}")
    ratio, rate = 1.0, 10.0
    if sampler.endswith("traceidratio"):
        ratio = _number(env, "OTEL_TRACES_SAMPLER_ARG", 1.0, 0.0, 1.0, kind=float)
    elif sampler.endswith("rpc_observe_ratelimit"):
        rate = _number(env, "OTEL_TRACES_SAMPLER_ARG", 10.0, 0.001, 1e6, kind=float)
    spans_max_bytes = _number(env, RPC_OBSERVE_SPANS_MAX_BYTES, 1 << 30, 0, 1 << 50)
    spans_file_bytes = _number(env, RPC_OBSERVE_SPANS_FILE_BYTES, 64 << 20, 1024, 1 << 50)
    if spans_max_bytes and spans_file_bytes > spans_max_bytes:  # a file must fit under the cap: a quarter does
        fitted = max(1, spans_max_bytes // 4)
        given = (env.get(RPC_OBSERVE_SPANS_FILE_BYTES) or "").strip()
        if given.isdigit() and int(given) == spans_file_bytes:  # set, and valid alone: not the default
            _warn(RPC_OBSERVE_SPANS_FILE_BYTES, given,
                  f"at most {RPC_OBSERVE_SPANS_MAX_BYTES} ({spans_max_bytes}) when a cap is set; using {fitted}")
        spans_file_bytes = fitted
    span_names = _choice(env, RPC_OBSERVE_SPAN_NAMES, ("key", "method"), "key",
                         "key (torch's profiling key) or method ({rpc.method})")
    addr = (env.get(RPC_OBSERVE_METRICS_ADDR) or "127.0.0.1").strip()
    peer_labels = _choice(env, RPC_OBSERVE_PEER_LABELS, _PEER_LABELS, "counters",
                          "counters (peers on the per-peer counters only) or histograms (also on the latency "
                          "histograms)")
    return Config(
        out_dir=env.get(RPC_OBSERVE_DIR) or "rpc_observe_out",
        run_id=env.get(RPC_OBSERVE_RUN_ID) or env.get("TORCHELASTIC_RUN_ID") or "",
        metrics=_flag(env, RPC_OBSERVE_METRICS, True) and bool(metrics_exporters),
        metrics_port=_number(env, RPC_OBSERVE_METRICS_PORT, None, 1, 65535),
        metrics_addr=addr,
        metrics_advertise_addr=(env.get(RPC_OBSERVE_METRICS_ADVERTISE_ADDR) or "").strip(),
        max_methods=_number(env, RPC_OBSERVE_MAX_METHODS, 100, 1, 100_000),
        max_peers=_number(env, RPC_OBSERVE_MAX_PEERS, 256, 1, 100_000),
        peer_labels=peer_labels,
        profiler_events=_flag(env, RPC_OBSERVE_PROFILER_EVENTS, True),
        profile=_flag(env, RPC_OBSERVE_PROFILE, False),
        profile_max_seconds=_number(env, RPC_OBSERVE_PROFILE_MAX_SECONDS, 300.0, 1.0, 86400.0, kind=float),
        span_names=span_names,
        max_exception_message=_number(env, RPC_OBSERVE_MAX_EXCEPTION_MESSAGE, 256, 0, 65536),
        signals=_flag(env, RPC_OBSERVE_SIGNALS, True),
        gil_profiling=_flag(env, RPC_OBSERVE_GIL_PROFILING, False),
        traces_exporters=exporters,
        otlp_protocol=protocol,
        sampler=sampler,
        sampler_ratio=ratio,
        sampler_rate=rate,
        spans_max_bytes=spans_max_bytes,
        spans_file_bytes=spans_file_bytes,
        propagators=_choices(
            env,
            "OTEL_PROPAGATORS",
            ("tracecontext", "baggage", "b3", "b3multi", "jaeger", "none"),
            ("tracecontext", "baggage"),
        ),
        service_name=env.get("OTEL_SERVICE_NAME", ""),
        bsp_schedule_delay_s=_number(env, "OTEL_BSP_SCHEDULE_DELAY", 1000, 1, 3_600_000, scale=1000),
        bsp_max_queue_size=_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 16384, 1, 10_000_000),
        bsp_max_export_batch_size=_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 2048, 1, 10_000_000),
        bsp_export_timeout_s=_number(env, "OTEL_BSP_EXPORT_TIMEOUT", 5000, 1, 3_600_000, scale=1000),
        recorder_size=_number(env, RPC_OBSERVE_RECORDER_SIZE, 1000, 0, 1_000_000),
        hang_seconds=_number(env, RPC_OBSERVE_HANG_SECONDS, DEFAULT_HANG_SECONDS, 0.0, 86400.0, kind=float),
        log_correlation=_flag(env, "OTEL_PYTHON_LOG_CORRELATION", True),
        keep_thread_states=_flag(env, RPC_OBSERVE_KEEP_THREAD_STATES, True),
        extensions=not _flag(env, "RPC_OBSERVE_NO_EXTENSIONS", False),
        metrics_exporters=metrics_exporters,
        metric_export_interval_s=_number(env, "OTEL_METRIC_EXPORT_INTERVAL", 60000, 100, 86_400_000, scale=1000),
        **(_otlp_metrics(env) if "otlp" in metrics_exporters else {}),
    )


def _otlp_metrics(env: Mapping[str, str]) -> dict[str, Any]:
    """Where OTLP metrics go: the OTEL_EXPORTER_OTLP_(METRICS_)* variables, as the OpenTelemetry SDK reads them."""
    import urllib.parse  # here: read only with OTEL_METRICS_EXPORTER=otlp, not at every interpreter start

    def first(suffix: str) -> tuple[str, str]:
        name = next((n for n in (f"OTEL_EXPORTER_OTLP_METRICS_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}")
                     if (env.get(n) or "").strip()), f"OTEL_EXPORTER_OTLP_{suffix}")
        return name, (env.get(name) or "").strip()

    name, endpoint = first("ENDPOINT")
    if endpoint and name == "OTEL_EXPORTER_OTLP_ENDPOINT":
        endpoint = endpoint.rstrip("/") + "/v1/metrics"  # the signal's path, as the SDK appends it
    if endpoint and not endpoint.startswith(("http://", "https://")):
        _warn(name, endpoint, "an http:// or https:// URL; using http://localhost:4318/v1/metrics")
        endpoint = ""
    name, text = first("HEADERS")
    headers = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _warn(name, text, f"comma-separated key=value pairs; ignoring {item!r}")
            continue
        headers.append((urllib.parse.unquote(key.strip()), urllib.parse.unquote(value.strip())))
    name, protocol = first("PROTOCOL")
    if protocol and protocol != "http/protobuf":
        _warn(name, protocol, "http/protobuf for OTLP metrics (built in); using http/protobuf")
    timeout_name = first("TIMEOUT")[0]
    return {"otlp_metrics_endpoint": endpoint or "http://localhost:4318/v1/metrics",
            "otlp_metrics_headers": tuple(headers),
            "otlp_metrics_timeout_s": _number(env, timeout_name, 10000, 1, 3_600_000, scale=1000)}
