"""`config.load(environ)`: every variable, its accepted values, and what a bad value gives.

Bad values never stop the job: each gives exactly one warning that names the variable and
what it accepts, and the documented default is used instead.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from rpc_observe import config

DEFAULT = config.Config()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rpc_observe" and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def warnings_captured(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")


# Moved from tests/test_units.py.
def test_config_defaults_and_bad_values(caplog: pytest.LogCaptureFixture) -> None:
    default = config.load({})
    assert default.traces_exporters == ("file",) and default.metrics_port is None
    assert default.bsp_schedule_delay_s == 1.0
    cfg = config.load({"OTEL_TRACES_EXPORTER": "none", "OTEL_BSP_EXPORT_TIMEOUT": "2500",
                       "RPC_OBSERVE_METRICS_PORT": "70000", "OTEL_TRACES_SAMPLER": "sometimes"})
    assert cfg.traces_exporters == () and not cfg.tracing and cfg.bsp_export_timeout_s == 2.5
    assert cfg.metrics_port is None and cfg.sampler == "parentbased_always_on"
    assert "RPC_OBSERVE_METRICS_PORT='70000' is not valid" in caplog.text
    assert "OTEL_TRACES_SAMPLER='sometimes' is not valid" in caplog.text
    assert config.enabled({"RPC_OBSERVE": "On"}) and not config.enabled({"RPC_OBSERVE": "0"})


def test_empty_environ_is_the_documented_defaults(caplog: pytest.LogCaptureFixture) -> None:
    assert config.load({}) == DEFAULT
    assert dataclasses.asdict(DEFAULT) == {
        "out_dir": "rpc_observe_out", "run_id": "", "metrics": True, "metrics_port": None,
        "metrics_addr": "127.0.0.1", "metrics_advertise_addr": "",
        "max_methods": 100, "max_peers": 256, "peer_labels": "counters",
        "profiler_events": True, "profile": False,
        "profile_max_seconds": 300.0, "span_names": "key", "max_exception_message": 256, "signals": True,
        "gil_profiling": False,
        "traces_exporters": ("file",), "otlp_protocol": "http/protobuf", "sampler": "parentbased_always_on",
        "sampler_ratio": 1.0, "sampler_rate": 10.0, "spans_max_bytes": 1073741824, "spans_file_bytes": 67108864,
        "propagators": ("tracecontext", "baggage"), "service_name": "",
        "bsp_schedule_delay_s": 1.0, "bsp_max_queue_size": 16384, "bsp_max_export_batch_size": 2048,
        "bsp_export_timeout_s": 5.0, "recorder_size": 1000, "hang_seconds": 30.0,
        "log_correlation": True, "keep_thread_states": True, "extensions": True, "metrics_exporters": ("prometheus",),
        "metric_export_interval_s": 60.0,
        "otlp_metrics_endpoint": "http://localhost:4318/v1/metrics", "otlp_metrics_headers": (),
        "otlp_metrics_timeout_s": 10.0}
    assert warnings_of(caplog) == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.metrics = False  # type: ignore[misc]


FLAG = "1/true/yes/on or 0/false/no/off"
# (variable, bad value, what the warning says is accepted, the environ it needs to be read at all)
BAD = [
    ("RPC_OBSERVE_METRICS", "maybe", f"{FLAG}; using 1", {}),
    ("RPC_OBSERVE_PROFILER_EVENTS", "2", f"{FLAG}; using 1", {}),
    ("RPC_OBSERVE_PROFILE", "sometimes", f"{FLAG}; using 0", {}),
    ("RPC_OBSERVE_SIGNALS", "enabled", f"{FLAG}; using 1", {}),
    ("RPC_OBSERVE_GIL_PROFILING", "enabled", f"{FLAG}; using 0", {}),
    ("RPC_OBSERVE_METRICS_PORT", "70000", "a int from 1 to 65535; using the OS's choice", {}),
    ("RPC_OBSERVE_METRICS_PORT", "0", "a int from 1 to 65535; using the OS's choice", {}),
    ("RPC_OBSERVE_METRICS_PORT", "http", "a int from 1 to 65535; using the OS's choice", {}),
    ("RPC_OBSERVE_METRICS_PORT", "9090.5", "a int from 1 to 65535; using the OS's choice", {}),
    ("RPC_OBSERVE_MAX_METHODS", "0", "a int from 1 to 100000; using 100", {}),
    ("RPC_OBSERVE_MAX_METHODS", "many", "a int from 1 to 100000; using 100", {}),
    ("RPC_OBSERVE_MAX_PEERS", "0", "a int from 1 to 100000; using 256", {}),
    ("RPC_OBSERVE_MAX_PEERS", "all", "a int from 1 to 100000; using 256", {}),
    ("RPC_OBSERVE_PEER_LABELS", "everywhere", "counters (peers on the per-peer counters only) or histograms "
     "(also on the latency histograms); using counters", {}),
    ("RPC_OBSERVE_PROFILE_MAX_SECONDS", "0.5", "a float from 1.0 to 86400.0; using 300.0", {}),
    ("RPC_OBSERVE_PROFILE_MAX_SECONDS", "nan", "a float from 1.0 to 86400.0; using 300.0", {}),
    ("RPC_OBSERVE_PROFILE_MAX_SECONDS", "inf", "a float from 1.0 to 86400.0; using 300.0", {}),
    ("RPC_OBSERVE_MAX_EXCEPTION_MESSAGE", "-1", "a int from 0 to 65536; using 256", {}),
    ("RPC_OBSERVE_SPAN_NAMES", "qualname", "key (torch's profiling key) or method ({rpc.method}); using key", {}),
    ("OTEL_TRACES_EXPORTER", "zipkin", "a comma-separated list of file, otlp, console, none; ignoring zipkin", {}),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "http/protobuf or grpc; using http/protobuf", {}),
    ("OTEL_TRACES_SAMPLER", "sometimes", "one of always_on, always_off, traceidratio, parentbased_always_on, "
     "parentbased_always_off, parentbased_traceidratio, rpc_observe_ratelimit, parentbased_rpc_observe_ratelimit; "
     "using parentbased_always_on", {}),
    ("OTEL_TRACES_SAMPLER_ARG", "1.5", "a float from 0.0 to 1.0; using 1.0", {"OTEL_TRACES_SAMPLER": "traceidratio"}),
    ("OTEL_TRACES_SAMPLER_ARG", "half", "a float from 0.0 to 1.0; using 1.0",
     {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}),
    ("OTEL_TRACES_SAMPLER_ARG", "0", "a float from 0.001 to 1000000.0; using 10.0",
     {"OTEL_TRACES_SAMPLER": "parentbased_rpc_observe_ratelimit"}),
    ("OTEL_TRACES_SAMPLER_ARG", "-3", "a float from 0.001 to 1000000.0; using 10.0",
     {"OTEL_TRACES_SAMPLER": "rpc_observe_ratelimit"}),
    ("RPC_OBSERVE_SPANS_MAX_BYTES", "-1", "a int from 0 to 1125899906842624; using 1073741824", {}),
    ("RPC_OBSERVE_SPANS_MAX_BYTES", "1GiB", "a int from 0 to 1125899906842624; using 1073741824", {}),
    ("RPC_OBSERVE_SPANS_FILE_BYTES", "512", "a int from 1024 to 1125899906842624; using 67108864", {}),
    ("RPC_OBSERVE_SPANS_FILE_BYTES", "0", "a int from 1024 to 1125899906842624; using 67108864", {}),
    # A file bigger than the cap: a quarter of the cap instead (what the cap alone gives).
    ("RPC_OBSERVE_SPANS_FILE_BYTES", "2000000", "at most RPC_OBSERVE_SPANS_MAX_BYTES (1000000) when a cap is set; "
     "using 250000", {"RPC_OBSERVE_SPANS_MAX_BYTES": "1000000"}),
    ("OTEL_PROPAGATORS", "xray", "a comma-separated list of tracecontext, baggage, b3, b3multi, jaeger, none; "
                                 "ignoring xray", {}),
    ("OTEL_BSP_SCHEDULE_DELAY", "0", "a int from 1 to 3600000; using 1000", {}),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "-5", "a int from 1 to 10000000; using 16384", {}),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "big", "a int from 1 to 10000000; using 2048", {}),
    ("OTEL_BSP_EXPORT_TIMEOUT", "1e3", "a int from 1 to 3600000; using 5000", {}),
    ("RPC_OBSERVE_RECORDER_SIZE", "-1", "a int from 0 to 1000000; using 1000", {}),
    ("RPC_OBSERVE_RECORDER_SIZE", "lots", "a int from 0 to 1000000; using 1000", {}),
    ("RPC_OBSERVE_HANG_SECONDS", "-5", "a float from 0.0 to 86400.0; using 30.0", {}),
    ("RPC_OBSERVE_HANG_SECONDS", "30s", "a float from 0.0 to 86400.0; using 30.0", {}),
    ("OTEL_PYTHON_LOG_CORRELATION", "maybe", "1/true/yes/on or 0/false/no/off; using 1", {}),
    ("RPC_OBSERVE_NO_EXTENSIONS", "c", "1/true/yes/on or 0/false/no/off; using 0", {}),
    ("RPC_OBSERVE_KEEP_THREAD_STATES", "always", "1/true/yes/on or 0/false/no/off; using 1", {}),
    ("OTEL_METRICS_EXPORTER", "statsd", "a comma-separated list of prometheus, otlp, none; ignoring statsd", {}),
    ("OTEL_METRIC_EXPORT_INTERVAL", "10", "a int from 100 to 86400000; using 60000", {}),
    ("OTEL_METRIC_EXPORT_INTERVAL", "1m", "a int from 100 to 86400000; using 60000", {}),
]


@pytest.mark.parametrize("name, bad, accepted, needs", BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_a_bad_value_warns_once_and_uses_the_default(caplog: pytest.LogCaptureFixture, name: str, bad: str,
                                                     accepted: str, needs: dict[str, str]) -> None:
    cfg = config.load({**needs, name: bad})
    assert cfg == config.load(needs)  # the default, and nothing else changed
    shown = bad.strip().lower() if name in LOWERCASED else bad
    assert warnings_of(caplog) == [f"rpc_observe: {name}={shown!r} is not valid: accepted {accepted}."]


LOWERCASED = {"RPC_OBSERVE_METRICS", "RPC_OBSERVE_PROFILER_EVENTS", "RPC_OBSERVE_PROFILE", "RPC_OBSERVE_SIGNALS",
              "RPC_OBSERVE_GIL_PROFILING", "RPC_OBSERVE_PEER_LABELS",
              "RPC_OBSERVE_SPAN_NAMES", "OTEL_TRACES_SAMPLER"}


def test_rpc_observe_itself(caplog: pytest.LogCaptureFixture) -> None:
    for value in ("1", "true", " Yes ", "ON"):
        assert config.enabled({"RPC_OBSERVE": value}) is True
    for value in ("0", "false", "no", "off", ""):
        assert config.enabled({"RPC_OBSERVE": value}) is False
    assert config.enabled({}) is False
    assert warnings_of(caplog) == []
    assert config.enabled({"RPC_OBSERVE": "maybe"}) is False
    assert warnings_of(caplog) == ["rpc_observe: RPC_OBSERVE='maybe' is not valid: accepted 1/true/yes/on to enable, "
                                   "0/false/no/off or unset to disable; staying off."]


def test_every_bad_value_at_once_gives_one_warning_each(caplog: pytest.LogCaptureFixture) -> None:
    env = {name: bad for name, bad, _, _ in reversed(BAD)}  # the first bad value of each variable
    env["OTEL_TRACES_SAMPLER"] = "traceidratio"  # a good one, so that the ratio is read
    assert config.load(env) == dataclasses.replace(DEFAULT, sampler="traceidratio")
    named = [re.match(r"rpc_observe: (\w+)=", m)[1] for m in warnings_of(caplog)]
    assert sorted(named) == sorted(set(env) - {"OTEL_TRACES_SAMPLER"})


def test_partly_bad_lists_keep_the_good_entries(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.load({"OTEL_TRACES_EXPORTER": " OTLP , zipkin,otlp", "OTEL_PROPAGATORS": "b3, xray, tracecontext"})
    assert cfg.traces_exporters == ("otlp",) and cfg.propagators == ("b3", "tracecontext")
    assert warnings_of(caplog) == [
        "rpc_observe: OTEL_TRACES_EXPORTER=' OTLP , zipkin,otlp' is not valid: accepted a comma-separated list of "
        "file, otlp, console, none; ignoring zipkin.",
        "rpc_observe: OTEL_PROPAGATORS='b3, xray, tracecontext' is not valid: accepted a comma-separated list of "
        "tracecontext, baggage, b3, b3multi, jaeger, none; ignoring xray."]


def test_good_values(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.load({
        "RPC_OBSERVE_DIR": "/tmp/out", "RPC_OBSERVE_RUN_ID": "run-1", "RPC_OBSERVE_METRICS": " Off ",
        "RPC_OBSERVE_METRICS_PORT": " 65535 ", "RPC_OBSERVE_METRICS_ADDR": " 0.0.0.0 ", "RPC_OBSERVE_MAX_METHODS": "1",
        "RPC_OBSERVE_METRICS_ADVERTISE_ADDR": " node7.cluster ",
        "RPC_OBSERVE_PROFILER_EVENTS": "no", "RPC_OBSERVE_PROFILE": "YES", "RPC_OBSERVE_PROFILE_MAX_SECONDS": "86400",
        "RPC_OBSERVE_SPAN_NAMES": "Method", "RPC_OBSERVE_MAX_EXCEPTION_MESSAGE": "0", "RPC_OBSERVE_SIGNALS": "false",
        "RPC_OBSERVE_GIL_PROFILING": "on", "RPC_OBSERVE_MAX_PEERS": " 1024 ",
        "RPC_OBSERVE_PEER_LABELS": " Histograms ",
        "OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_TRACES_SAMPLER": " TraceIdRatio ", "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_PROPAGATORS": "b3multi",
        "OTEL_SERVICE_NAME": "trainer", "OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_BSP_MAX_QUEUE_SIZE": "1",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10000000", "OTEL_BSP_EXPORT_TIMEOUT": "1",
        "RPC_OBSERVE_RECORDER_SIZE": " 0 ", "RPC_OBSERVE_HANG_SECONDS": "2.5", "OTEL_PYTHON_LOG_CORRELATION": "False",
        "RPC_OBSERVE_NO_EXTENSIONS": "1", "RPC_OBSERVE_KEEP_THREAD_STATES": "Off",
    })
    assert dataclasses.asdict(cfg) == {
        "out_dir": "/tmp/out", "run_id": "run-1", "metrics": False, "metrics_port": 65535, "metrics_addr": "0.0.0.0",
        "metrics_advertise_addr": "node7.cluster",
        "max_methods": 1, "max_peers": 1024, "peer_labels": "histograms", "profiler_events": False, "profile": True,
        "profile_max_seconds": 86400.0,
        "span_names": "method", "max_exception_message": 0, "signals": False, "gil_profiling": True,
        "traces_exporters": ("otlp", "console"), "otlp_protocol": "grpc", "sampler": "traceidratio",
        "sampler_ratio": 0.25, "sampler_rate": 10.0, "spans_max_bytes": 1073741824, "spans_file_bytes": 67108864,
        "propagators": ("b3multi",), "service_name": "trainer", "bsp_schedule_delay_s": 0.25,
        "bsp_max_queue_size": 1, "bsp_max_export_batch_size": 10_000_000, "bsp_export_timeout_s": 0.001,
        "recorder_size": 0, "hang_seconds": 2.5, "log_correlation": False, "keep_thread_states": False,
        "extensions": False,
        "metrics_exporters": ("prometheus",),
        "metric_export_interval_s": 60.0, "otlp_metrics_endpoint": "http://localhost:4318/v1/metrics",
        "otlp_metrics_headers": (), "otlp_metrics_timeout_s": 10.0}
    assert warnings_of(caplog) == []


def test_special_cases(caplog: pytest.LogCaptureFixture) -> None:
    assert config.load({"OTEL_TRACES_EXPORTER": "file,none"}).traces_exporters == ()  # none wins
    assert config.load({"TORCHELASTIC_RUN_ID": "elastic"}).run_id == "elastic"
    assert config.load({"TORCHELASTIC_RUN_ID": "elastic", "RPC_OBSERVE_RUN_ID": "mine"}).run_id == "mine"
    protocols = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    assert config.load(protocols).otlp_protocol == "grpc"  # the signal-specific variable wins
    # The ratio is read only for the ratio samplers: a bad one is not even looked at otherwise.
    assert config.load({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "bad"}).sampler_ratio == 1.0
    for boundary in ("0", "1", "0.0", "1.0"):
        cfg = config.load({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": boundary})
        assert cfg.sampler_ratio == float(boundary)
    assert warnings_of(caplog) == []


def test_span_file_bounds_and_the_rate_limited_sampler(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.load({"RPC_OBSERVE_SPANS_MAX_BYTES": "0", "RPC_OBSERVE_SPANS_FILE_BYTES": " 1024 "})
    assert (cfg.spans_max_bytes, cfg.spans_file_bytes) == (0, 1024)  # 0: no cap; rotation still at the size
    cfg = config.load({"RPC_OBSERVE_SPANS_MAX_BYTES": "300000"})  # the default file size does not fit: a quarter
    assert (cfg.spans_max_bytes, cfg.spans_file_bytes) == (300000, 75000)
    cfg = config.load({"RPC_OBSERVE_SPANS_MAX_BYTES": "300000", "RPC_OBSERVE_SPANS_FILE_BYTES": "300000"})
    assert cfg.spans_file_bytes == 300000  # equal to the cap is allowed
    cfg = config.load({"RPC_OBSERVE_SPANS_MAX_BYTES": "0", "RPC_OBSERVE_SPANS_FILE_BYTES": str(1 << 40)})
    assert cfg.spans_file_bytes == 1 << 40  # no cap: any size
    for sampler in ("rpc_observe_ratelimit", "parentbased_rpc_observe_ratelimit"):
        cfg = config.load({"OTEL_TRACES_SAMPLER": sampler.upper(), "OTEL_TRACES_SAMPLER_ARG": "2.5"})
        assert (cfg.sampler, cfg.sampler_rate, cfg.sampler_ratio) == (sampler, 2.5, 1.0)
    assert config.load({"OTEL_TRACES_SAMPLER": "parentbased_rpc_observe_ratelimit"}).sampler_rate == 10.0
    # The rate is read only for the rate-limited samplers, the ratio only for the ratio ones.
    assert config.load({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}).sampler_rate == 10.0
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("name", ["RPC_OBSERVE_METRICS_PORT", "RPC_OBSERVE_MAX_METHODS", "OTEL_BSP_SCHEDULE_DELAY",
                                  "RPC_OBSERVE_MAX_PEERS", "RPC_OBSERVE_PEER_LABELS",
                                  "OTEL_TRACES_EXPORTER", "OTEL_PROPAGATORS", "OTEL_TRACES_SAMPLER",
                                  "RPC_OBSERVE_SPAN_NAMES", "RPC_OBSERVE_PROFILE", "RPC_OBSERVE_METRICS_ADDR",
                                  "RPC_OBSERVE_SPANS_MAX_BYTES", "RPC_OBSERVE_SPANS_FILE_BYTES"])
def test_an_empty_value_is_unset(caplog: pytest.LogCaptureFixture, name: str) -> None:
    assert config.load({name: ""}) == DEFAULT
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("name", ["RPC_OBSERVE_METRICS", "RPC_OBSERVE_PROFILER_EVENTS", "RPC_OBSERVE_SIGNALS"])
def test_an_empty_flag_is_unset(caplog: pytest.LogCaptureFixture, name: str) -> None:
    assert config.load({name: ""}) == DEFAULT


def test_a_bad_traces_protocol_names_its_own_variable(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.load({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"})
    assert cfg.otlp_protocol == "http/protobuf"
    assert warnings_of(caplog) == ["rpc_observe: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='thrift' is not valid: accepted "
                                   "http/protobuf or grpc; using http/protobuf."]


FREE_FORM = {"RPC_OBSERVE", "RPC_OBSERVE_DIR", "RPC_OBSERVE_RUN_ID", "RPC_OBSERVE_METRICS_ADDR",
             "RPC_OBSERVE_METRICS_ADVERTISE_ADDR", "OTEL_SERVICE_NAME",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "TORCHELASTIC_RUN_ID",
             "OTEL_EXPORTER_OTLP_ENDPOINT"}  # no bad value, or tested on its own


def test_every_variable_config_reads_is_covered_here() -> None:
    """A new variable in config.py needs a line in BAD (or FREE_FORM) above."""
    source = Path(config.__file__).read_text(encoding="utf-8")
    read = set(re.findall(r'"((?:RPC_OBSERVE|OTEL|TORCHELASTIC)[A-Z_]*)"', source))
    assert read - FREE_FORM - {name for name, *_ in BAD} == set()
    assert {name for name, *_ in BAD} <= read


def test_otlp_metrics_take_the_standard_variables_the_metrics_ones_first(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.load({"OTEL_METRICS_EXPORTER": "otlp, prometheus", "OTEL_METRIC_EXPORT_INTERVAL": "500",
                       "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_EXPORTER_OTLP_TIMEOUT": "2000",
                       "OTEL_EXPORTER_OTLP_HEADERS": "a=1,b=x%20y", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "250"})
    assert (cfg.metrics, cfg.metrics_exporters, cfg.metric_export_interval_s) == (True, ("otlp", "prometheus"), 0.5)
    assert cfg.otlp_metrics_endpoint == "http://collector:4318/v1/metrics"  # the signal's path appended
    assert (cfg.otlp_metrics_headers, cfg.otlp_metrics_timeout_s) == ((("a", "1"), ("b", "x y")), 0.25)
    cfg = config.load({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:4318",
                       "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://c:4318/custom"})
    assert cfg.otlp_metrics_endpoint == "https://c:4318/custom"  # a signal's own endpoint is used as it is
    assert warnings_of(caplog) == []


def test_bad_otlp_metrics_variables_warn_and_fall_back(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.load({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "collector:4318",
                       "OTEL_EXPORTER_OTLP_HEADERS": "good=1,bad", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"})
    assert cfg.otlp_metrics_endpoint == "http://localhost:4318/v1/metrics"
    assert cfg.otlp_metrics_headers == (("good", "1"),)
    assert warnings_of(caplog) == [
        "rpc_observe: OTEL_EXPORTER_OTLP_METRICS_ENDPOINT='collector:4318' is not valid: accepted an http:// or "
        "https:// URL; using http://localhost:4318/v1/metrics.",
        "rpc_observe: OTEL_EXPORTER_OTLP_HEADERS='good=1,bad' is not valid: accepted comma-separated key=value "
        "pairs; ignoring 'bad'.",
        "rpc_observe: OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='grpc' is not valid: accepted http/protobuf for OTLP "
        "metrics (built in); using http/protobuf.",
    ]


def test_otel_metrics_exporter_none_turns_metrics_off() -> None:
    assert config.load({"OTEL_METRICS_EXPORTER": "none"}).metrics is False
    assert config.load({"OTEL_METRICS_EXPORTER": "prometheus"}).metrics is True
