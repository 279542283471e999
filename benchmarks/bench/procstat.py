"""CPU time of processes and of their threads, from /proc (standard library only: the workers import it too).

- A process's CPU is utime + stime of /proc/<pid>/stat: all its threads, live and exited, in clock
  ticks (10 ms here; the kernel derives them from the exact run time, so only the last tick is lost).
- A thread's CPU is the first field of /proc/<pid>/task/<tid>/schedstat (run time in ns) where the
  kernel has it, else utime + stime of /proc/<pid>/task/<tid>/stat (ticks). Only live threads have
  one, so the per-thread view is read around windows in which the threads that matter stay alive.
- Threads are grouped by name: the OS name (`comm`) for threads that torch or TensorPipe named
  (`pt_thread_pool`, `TP_UV_loop`, ...), the Python name (`threading.Thread(name=...)`, which
  Python 3.11 does not pass to the OS) for Python threads, looked up by `native_id` in a map the
  process itself reports, `main` for the thread whose id is the process id.
"""

from __future__ import annotations

import os
import re
from typing import Any

TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
_HAS_SCHEDSTAT = os.path.exists("/proc/self/schedstat")
THREAD_CLOCK = "schedstat (ns)" if _HAS_SCHEDSTAT else "stat utime+stime (ticks)"


def _stat_fields(path: str) -> list[str]:
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_us(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited), in microseconds."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) * TICK_US


def thread_cpu(pid: int, first: str | None = None, last: str | None = None) -> dict[str, list[Any]]:
    """{tid: [comm, CPU us]} for every live thread of `pid` (tids as strings, as JSON keys are);
    thread `first` is read first, `last` last (the reading thread itself: so that its own reading
    work falls outside a window that starts with `last=` and ends with `first=`)."""
    out: dict[str, list[Any]] = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    if first in tids:
        tids.remove(first)
        tids.insert(0, first)
    if last in tids:
        tids.remove(last)
        tids.append(last)
    for tid in tids:
        try:
            with open(f"{base}/{tid}/comm") as f:
                comm = f.read().strip()
            if _HAS_SCHEDSTAT:
                with open(f"{base}/{tid}/schedstat") as f:
                    us = int(f.read().split()[0]) / 1e3
            else:
                fields = _stat_fields(f"{base}/{tid}/stat")
                us = (int(fields[11]) + int(fields[12])) * TICK_US
        except (OSError, ValueError, IndexError):
            continue  # the thread exited while being read
        out[tid] = [comm, us]
    return out


def thread_delta(before: dict[str, list[Any]], after: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """CPU us per thread between two `thread_cpu` snapshots; a thread that started in between
    counts from zero, one that ended in between is missing (its time is in the process total)."""
    return {tid: [comm, us - (before[tid][1] if tid in before else 0.0)] for tid, (comm, us) in after.items()}


def snapshot(pids: list[int], first: str | None = None, last: str | None = None) -> list[dict[str, Any]]:
    """Per process: utime+stime from /proc/<pid>/stat and every live thread's CPU."""
    return [{"stat_us": cpu_us(pid), "threads": thread_cpu(pid, first, last)} for pid in pids]


def window(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per process, between two `snapshot`s: `us`, the sum of its threads' CPU when no thread ended in
    between (exact to the ns with schedstat), else (`exact` False) utime+stime from /proc/<pid>/stat,
    which also holds the ended threads' time but only to the clock tick; `stat_us` and `threads` too."""
    out = []
    for b, a in zip(before, after):
        threads = thread_delta(b["threads"], a["threads"])
        exact = _HAS_SCHEDSTAT and bool(threads) and all(tid in a["threads"] for tid in b["threads"])
        stat = a["stat_us"] - b["stat_us"]
        out.append({"us": sum(us for _, us in threads.values()) if exact else stat, "stat_us": stat,
                    "exact": exact, "threads": threads})
    return out


def python_thread_names() -> dict[str, str]:
    """{native thread id: Python thread name} of this process's Python threads (the map `group` needs)."""
    import threading

    return {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}


_NUMBERED = re.compile(r"[-_ ]?\(?\d+\)?")
POOL = "torch pool (pt_thread_pool)"


def group(tid: str, comm: str, pid: int, py_names: dict[str, str], proc_comm: str = "python") -> str:
    """The thread group a thread's CPU is reported under."""
    if tid == str(pid):
        return "main"
    if comm != proc_comm:  # named by torch (pool threads), TensorPipe (TP_*), gloo, ...
        return POOL if comm == "pt_thread_pool" else comm
    name = py_names.get(tid)
    if name is None:
        return "unnamed C++ threads"
    if name.startswith("rpc_observe-"):
        return name
    if name.startswith("OtelBatch"):
        return "OtelBatchSpanRecordProcessor (SDK export)"
    return "python: " + (_NUMBERED.sub("", name) or name)


def grouped(delta: dict[str, list[Any]], pid: int, py_names: dict[str, str]) -> dict[str, float]:
    """CPU us per thread group of one process, from a `thread_delta`."""
    proc_comm = delta.get(str(pid), ["python"])[0]
    out: dict[str, float] = {}
    for tid, (comm, us) in delta.items():
        key = group(tid, comm, pid, py_names, proc_comm)
        out[key] = out.get(key, 0.0) + us
    return out
