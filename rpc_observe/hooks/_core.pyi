# The per-call core in C (_core.c, built by hatch_build.py where a C compiler works); trailer.py has the references.
from collections.abc import Callable, Iterator
from typing import Any

def parse(data: bytes, /) -> tuple[int, int, int] | tuple[int, list[str]] | None: ...
def request_trailer(head: str, call_id: int, context: str, /) -> bytes: ...
def response_trailer(call_id: str, callee_us: int, /) -> bytes: ...
def configure(in_flight: dict[int, Any], finished_append: Callable[[Any], None], fold_message: Any, fold_split: Any,
              fold_finished: Any, remote_exception: type, python_udf: type,
              request_cells: Callable[..., Any], finish_call: Callable[..., None], not_handled: object,
              time_ns: Callable[[], int], local: Any, next_id: Callable[[], int], pending_replies: dict[int, Any],
              max_in_flight: int, /) -> None: ...
def configure_hooks(runtime_module: Any, perf_counter: Callable[[], float], internal_error: Callable[[str], None],
                    on_other_message: Callable[..., Any], serialize_other: Callable[..., Any], /) -> None: ...

SERIALIZE: int
DESERIALIZE: int
RUN_FUNCTION: int
INVOKE_RPC: int

class Hook:
    """_InternalRPCPickler.serialize (kind SERIALIZE) or deserialize (DESERIALIZE), wrapped in C."""

    original: Any
    kind: int
    def __init__(self, original: Any, kind: int, /) -> None: ...
    def __call__(self, *args: Any) -> Any: ...
class CallBase:
    """The fields of calls.Call as a C struct (calls.Call subclasses it where the core is built)."""

    runtime: Any
    site: Any
    span: Any
    rf: Any
    future: Any
    parent: Any
    start_ns: int
    id: int
    tid: int
    thread: int

def configure_run(serving: dict[int, Any], proxies: Any, site_of: Callable[..., Any], end_other: Callable[..., None],
                  fold_served: Any, unknown: str, /) -> None: ...
def configure_invoke(call_type: type[CallBase], begin: Callable[..., Any], end_raised: Callable[..., None],
                     after_invoke: Callable[..., Any], profiler_enabled: Callable[[], bool],
                     native_id: Callable[[], int], /) -> None: ...
def new_call(runtime: Any, site: Any, /) -> Any: ...
def configure_fold(fold_message: Any, fold_started: Any, fold_finished: Any, fold_split: Any, fold_served: Any,
                   size_buckets: tuple[float, ...], count_buckets: tuple[float, ...],
                   latency_buckets: tuple[float, ...], serialization_buckets: tuple[float, ...],
                   message_cells: type, client_cells: type, server_cells: type, /) -> None: ...
def fold(records: Any, n: int, /) -> None: ...
def take_incoming() -> tuple[Any, list[str], float] | None: ...

class Records:
    """The metrics' record queue (metrics.RecordQueue): a deque of metrics.py's tuples to Python; the hot paths
    push records into it without making them."""

    def append(self, record: Any, /) -> None: ...
    def popleft(self) -> Any: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Any]: ...
def configure_spans(span_type: type, getrandbits: Callable[[int], int], trace_module: Any,
                    get_current: Callable[[], Any], span_key: str, baggage_key: str, traceparent_format: str,
                    flags: tuple[str, str], /) -> None: ...
def parse_traceparent(entry: str, /) -> tuple[int, int, bool] | None: ...
