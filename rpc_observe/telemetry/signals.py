"""SIGTERM (and a default SIGINT): write what is queued before the process goes.

torchrun, mp.spawn (after one worker failed), SLURM and Kubernetes stop workers with
SIGTERM, whose default action kills the process without running atexit: the last spans,
the ones a user most wants after a failure, would be lost, and the file_sd target would
stay behind. On the signal, the telemetry is closed (the calls in flight end with
error.type=shutdown, spans are flushed within OTEL_BSP_EXPORT_TIMEOUT, the target file
is removed), then the signal is handed on to the handler that was there before: the
default action terminates the process, by the same signal, as before.

A Python handler runs only when the main thread next runs Python code, and a training
loop's main thread is often blocked in C++ (`fut.wait()`): so the C-level handler's
wakeup fd (`signal.set_wakeup_fd`, when nobody else uses it) wakes a watcher thread that
closes at once and, for a default action, terminates the process itself. Installed only
from the main thread, only over the default or a Python handler; SIGINT only when it has
the default action (Python's KeyboardInterrupt unwinds into atexit, which closes anyway).
RPC_OBSERVE_SIGNALS=0 switches it off.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from . import health

_installed: dict[int, Any] = {}  # signal number -> the handler that was there before
_wakeup: list[int] = []  # [read fd, write fd, previous wakeup fd] while the watcher runs


def install(close: Callable[[], None]) -> None:
    """Installs the handler for SIGTERM (and SIGINT if it has its default action)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(signum)
            python_handler = callable(previous) and signum == signal.SIGTERM
            if signum in _installed or not (previous == signal.SIG_DFL or python_handler):
                continue  # ignored, Python's own SIGINT handler, or a handler not set from Python
            signal.signal(signum, _handler(close, previous))
            _installed[signum] = previous
        except (ValueError, OSError):
            health.internal_error("signal_install")
    if _installed and not _wakeup:
        _start_watcher(close)


def _handler(close: Callable[[], None], previous: Any) -> Callable[[int, FrameType | None], None]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        try:
            close()
        except Exception:
            health.internal_error("signal_close")
        signal.signal(signum, previous)
        _installed.pop(signum, None)
        if callable(previous):
            previous(signum, frame)
        else:  # the default action, as if we had never been here
            os.kill(os.getpid(), signum)

    return on_signal


def _start_watcher(close: Callable[[], None]) -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous_fd = -2
    if previous_fd != -1:  # someone else's (asyncio): leave it, the Python handler alone will do
        if previous_fd >= 0:
            signal.set_wakeup_fd(previous_fd)
        os.close(read_fd)
        os.close(write_fd)
        return
    _wakeup[:] = [read_fd, write_fd]
    threading.Thread(target=_watch, args=(read_fd, close), name="rpc_observe-signals", daemon=True).start()


def _watch(read_fd: int, close: Callable[[], None]) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in _installed:
                continue
            try:
                close()
            except Exception:
                health.internal_error("signal_close")
            if _installed.get(signum) == signal.SIG_DFL:
                _terminate(signum)


def _terminate(signum: int) -> None:
    """The default action of `signum`, from any thread: reset the disposition in libc, re-raise."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(ctypes.c_int(signum), ctypes.c_void_p(0))  # SIG_DFL
    os.kill(os.getpid(), signum)


def uninstall() -> None:
    """Puts back the handlers that were there before (uninstrument)."""
    for signum, previous in list(_installed.items()):
        try:
            signal.signal(signum, previous)
        except (ValueError, OSError):
            pass
        _installed.pop(signum, None)
    if _wakeup:
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass
        for fd in _wakeup:
            os.close(fd)
        _wakeup.clear()
