"""Serving /metrics and /debug/rpc over HTTP, and announcing the endpoint as a Prometheus file_sd target.

The server is prometheus_client's WSGI app behind a small router: `/metrics` (and `/`, as
prometheus_client serves it) give the metrics, `/debug/rpc` the flight recorder's JSON,
anything else 404. Each request runs on a thread of its own (a ThreadingMixIn server), so
neither a slow client nor a snapshot ever holds up a scrape or an RPC thread.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from ..config import RPC_OBSERVE_METRICS_PORT, Config

_logger = logging.getLogger("rpc_observe")


def local_rank(rank: int | None) -> int:
    """LOCAL_RANK if the launcher set it (torchrun does), else the RPC rank."""
    value = os.environ.get("LOCAL_RANK", "")
    if value.isdigit():
        return int(value)
    return rank if rank is not None and rank >= 0 else 0


DebugSource = Callable[[], "bytes | None"]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no line on stderr per request
        pass


def _router(metrics_app: Callable[..., Iterable[bytes]], debug: DebugSource | None) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path in ("/", "/metrics"):
            return metrics_app(environ, start_response)
        body = debug() if debug is not None and path == "/debug/rpc" else None
        if body is None:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: this endpoint serves /metrics and /debug/rpc\n"]
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def start_http_server(port: int, addr: str, registry: CollectorRegistry,
                      debug: DebugSource | None = None) -> tuple[WSGIServer, threading.Thread]:
    """prometheus_client's `start_http_server`, with the router in front of its app."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    addr = str(sockaddr[0])
    server_class = type("_FamilyServer", (_Server,), {"address_family": family})
    app = _router(make_wsgi_app(registry), debug)
    httpd: WSGIServer = make_server(addr, port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="rpc_observe-http", daemon=True)
    thread.start()
    return httpd, thread


def serve(registry: CollectorRegistry, config: Config, rank: int | None,
          debug: DebugSource | None = None) -> tuple[WSGIServer, int]:
    """Starts the HTTP server on base port + local rank, or on a free port if that fails."""
    port = 0
    if config.metrics_port is not None:
        port = config.metrics_port + local_rank(rank)
        if port > 65535:
            _logger.warning(
                "rpc_observe: %s=%d plus local rank %d is above 65535; using a free port",
                RPC_OBSERVE_METRICS_PORT,
                config.metrics_port,
                local_rank(rank),
            )
            port = 0
    try:
        server, _ = start_http_server(port, config.metrics_addr, registry, debug)
    except OSError as e:
        if port == 0:
            raise
        _logger.warning(
            "rpc_observe: metrics port %d (%s=%d + local rank) is not available (%s); "
            "using a free port instead, see the file_sd target for which",
            port,
            RPC_OBSERVE_METRICS_PORT,
            config.metrics_port,
            e.strerror or e,
        )
        server, _ = start_http_server(0, config.metrics_addr, registry, debug)
    return server, server.server_address[1]


def write_target(targets_dir: str, worker: str, addr: str, port: int, run_id: str, advertise: str = "") -> str:
    """Writes `<targets_dir>/<worker>.json` in Prometheus file_sd format, atomically.

    The target names `advertise` if set (RPC_OBSERVE_METRICS_ADVERTISE_ADDR: how other hosts
    reach this one), else the bind address, loopback for a wildcard bind.
    """
    host = advertise or ("127.0.0.1" if addr in ("", "0.0.0.0") else ("[::1]" if addr == "::" else addr))
    if ":" in host and not host.startswith("["):  # an IPv6 address: host:port needs brackets
        host = f"[{host}]"
    target = [
        {
            "targets": [f"{host}:{port}"],
            # No `worker` label here: every sample already carries it, and a target label of
            # the same name would make Prometheus rename the sample's to `exported_worker`.
            "labels": {"job": "rpc_observe", "rpc_observe_run_id": run_id},
        }
    ]
    path = os.path.join(targets_dir, f"{worker}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(target, f)
    os.replace(tmp, path)
    return path
