"""benchmarks/bench/profiling.py's reading of `perf script` call stacks: which samples are the add-on's own code.

The stacks below are cut from a real (d) caller's `perf script -F comm,pid,tid,ip,sym,dso --no-inline`
(each header ends in a space, as perf writes it)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
python 29472/29472\x20
\t          1f2b3c unicode_hash (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
\t          1f2b00 PyDict_GetItemWithError (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
\t            9c6e hook_call (/work/main/rpc_observe/hooks/_core.cpython-311-x86_64-linux-gnu.so)
\t          1a0b00 _PyEval_EvalFrameDefault (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)

python 29472/29472\x20
\t          1f0000 _PyObject_Malloc (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
\t          1a0b00 _PyEval_EvalFrameDefault (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
\t          1a0c00 _PyEval_Vector (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
\t            9c6e hook_call (/work/main/rpc_observe/hooks/_core.cpython-311-x86_64-linux-gnu.so)
\t          1a0b00 _PyEval_EvalFrameDefault (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)

pt_thread_pool 29472/29493\x20
\t            4a10 slot_offset (/work/main/rpc_observe/hooks/_core.cpython-311-x86_64-linux-gnu.so)
\t            9c6e hook_call (/work/main/rpc_observe/hooks/_core.cpython-311-x86_64-linux-gnu.so)

TP_UV_loop 29472/29526\x20
\t          108cae epoll_pwait (/usr/lib/x86_64-linux-gnu/libc.so.6)

python 29472/29530\x20
\t            2200 encode_spans (/work/main/rpc_observe/telemetry/_spanjson.cpython-311-x86_64-linux-gnu.so)
"""


def test_own_code_is_told_from_the_call_a_hook_wraps() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench import profiling
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    stacks = profiling.perf_stacks(SCRIPT)
    assert [thread for thread, _ in stacks] == ["main", "main", "RPC pool", "uv loop", "other (python)"]
    assert [profiling.own_kind(frames) for _, frames in stacks] == ["own", "under a hook", "own", "rest", "own"]
    assert stacks[2][1] == ["slot_offset [_core]", "hook_call [_core]"]
