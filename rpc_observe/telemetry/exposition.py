"""Serving /metrics over HTTP and announcing the endpoint as a Prometheus file_sd target."""

from __future__ import annotations

import json
import logging
import os

from prometheus_client import CollectorRegistry, start_http_server

from ..config import RPC_OBSERVE_METRICS_PORT, Config

_logger = logging.getLogger("rpc_observe")


def local_rank(rank: int | None) -> int:
    """LOCAL_RANK if the launcher set it (torchrun does), else the RPC rank."""
    value = os.environ.get("LOCAL_RANK", "")
    if value.isdigit():
        return int(value)
    return rank if rank is not None and rank >= 0 else 0


def serve(registry: CollectorRegistry, config: Config, rank: int | None) -> tuple[object, int]:
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
        server, _ = start_http_server(port, addr=config.metrics_addr, registry=registry)
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
        server, _ = start_http_server(0, addr=config.metrics_addr, registry=registry)
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
