"""Trace ids in log records (OTEL_PYTHON_LOG_CORRELATION), on real workers: the ids a UDF's and a
caller's `logging` lines print are those of the SERVER and CLIENT spans in the span files."""

from __future__ import annotations

from pathlib import Path

from cluster import Cluster

SERVER, CLIENT = 2, 3


def log_lines(path: Path) -> dict[str, tuple[str, str, str, str]]:
    """message -> (trace id, span id, service name, sampled) of a worker's log file."""
    lines = {}
    for line in path.read_text().splitlines():
        trace_id, span_id, service, sampled, message = line.split("|", 4)
        assert message not in lines, f"{message!r} logged twice"
        lines[message] = (trace_id, span_id, service, sampled)
    return lines


def test_log_records_carry_the_ids_of_the_span_they_were_made_in(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, "logs", env={"RPC_OBSERVE": "1"})
    assert cluster.wait()[0]["logged"] is True
    spans = [s for s in cluster.spans() if s["attrs"].get("rpc.method") == "logging_udf"]
    by_id = {s["spanId"]: s for s in spans}
    logs = {w: log_lines(tmp_path / f"{w}.log") for w in ("worker0", "worker1", "worker2")}

    def span_of(worker: str, message: str, kind: int) -> dict:
        trace_id, span_id, service, sampled = logs[worker][message]
        assert (service, sampled) == (worker, "True"), (worker, message, logs[worker][message])
        span = by_id[span_id]
        assert (span["traceId"], span["worker"], span["kind"]) == (trace_id, worker, kind), (message, span)
        return span

    # Outside any call, before init_rpc too: empty values, and the format string did not raise.
    for message in ("before init_rpc", "before", "between", "after"):
        assert logs["worker0"][message] == ("", "", "", "False")
    assert logs["worker1"]["before init_rpc"] == logs["worker2"]["before init_rpc"] == ("", "", "", "False")
    # The caller, while its rpc_async is in flight: that CLIENT span.
    in_flight = span_of("worker0", "in flight", CLIENT)
    # The UDF it called: the SERVER span that is the child of that CLIENT span.
    assert span_of("worker1", "udf depth=0", SERVER)["parentSpanId"] == in_flight["spanId"]
    # The rpc_sync's UDF: its SERVER span before and after its own nested call, the nested CLIENT
    # span while that is in flight, and on worker2 the SERVER span of that nested call.
    served = span_of("worker1", "udf depth=1", SERVER)
    assert span_of("worker1", "udf after depth=1", SERVER) is served
    nested = span_of("worker1", "udf waiting depth=1", CLIENT)
    assert nested["parentSpanId"] == served["spanId"]
    assert span_of("worker2", "udf depth=0", SERVER)["parentSpanId"] == nested["spanId"]
    assert by_id[served["parentSpanId"]]["worker"] == "worker0"
