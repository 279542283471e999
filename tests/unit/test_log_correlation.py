"""Trace ids in log records (hooks/log_correlation.py): the factory, its switch, and the way back.
The ids of real RPC spans in real workers' log lines: tests/test_logs_e2e.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace

from rpc_observe import config
from rpc_observe.hooks import log_correlation

FORMAT = "%(otelTraceID)s|%(otelSpanID)s|%(otelServiceName)s|%(otelTraceSampled)s|%(message)s"


@pytest.fixture
def installed() -> Iterator[None]:
    original = logging.getLogRecordFactory()
    log_correlation.install()
    yield
    log_correlation.uninstall()
    assert logging.getLogRecordFactory() is original


def formatted(message: str) -> str:
    record = logging.getLogger("t").makeRecord("t", logging.INFO, __file__, 1, message, (), None)
    return logging.Formatter(FORMAT).format(record)


def test_a_record_outside_any_call_or_span_gets_empty_values(installed: None) -> None:
    assert formatted("m") == "|||False|m"


def test_a_record_inside_an_opentelemetry_span_gets_its_ids(installed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    with provider.get_tracer("t").start_as_current_span("user span") as span:
        context = span.get_span_context()
        assert formatted("m") == f"{context.trace_id:032x}|{context.span_id:016x}||True|m"
    assert formatted("m") == "|||False|m"


def test_install_twice_wraps_once_and_someone_elses_factory_survives_uninstall() -> None:
    original = logging.getLogRecordFactory()
    log_correlation.install()
    ours = logging.getLogRecordFactory()
    log_correlation.install()
    assert logging.getLogRecordFactory() is ours

    def theirs(*args: object, **kwargs: object) -> logging.LogRecord:
        return ours(*args, **kwargs)

    logging.setLogRecordFactory(theirs)
    try:
        log_correlation.uninstall()
        assert logging.getLogRecordFactory() is theirs  # replaced since: left alone
    finally:
        logging.setLogRecordFactory(original)


def test_a_failing_lookup_is_counted_and_the_record_still_made(installed: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from rpc_observe.telemetry import health

    def broken() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(log_correlation, "current_ids", broken)
    assert formatted("m") == "|||False|m"
    assert health.internal_errors["log_correlation"] == 1


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("false", False), ("true", True)])
def test_otel_python_log_correlation_switches_it(value: str | None, expected: bool) -> None:
    environ = {} if value is None else {"OTEL_PYTHON_LOG_CORRELATION": value}
    assert config.load(environ).log_correlation is expected
