"""Switching on and off: the environment variable, instrument()/uninstrument(), start-up."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from cluster import Cluster, clean_env

ROOT = Path(__file__).resolve().parent.parent

# Every torch attribute rpc_observe may replace, as (module, attribute, class attribute or None).
SNAPSHOT = r"""
import json, sys, torch, torch.distributed.rpc as rpc
from torch.distributed.rpc import api, internal
import torch.autograd.profiler as ap
import torch.distributed.autograd as dist_autograd
from torch._C._distributed_rpc import PyRRef
from torch.distributed.optim import DistributedOptimizer

def snapshot():
    return {
        "api._invoke_rpc": id(api._invoke_rpc), "api.remote": id(api.remote), "rpc.remote": id(rpc.remote),
        "api.rpc_async": id(api.rpc_async), "rpc.rpc_async": id(rpc.rpc_async), "api.rpc_sync": id(api.rpc_sync),
        "rpc.rpc_sync": id(rpc.rpc_sync),
        "internal._run_function": id(internal._run_function),
        "pickler.serialize": id(internal._InternalRPCPickler.__dict__["serialize"]),
        "pickler.deserialize": id(internal._InternalRPCPickler.__dict__["deserialize"]),
        "rpc.init_rpc": id(rpc.init_rpc), "api.shutdown": id(api.shutdown), "rpc.shutdown": id(rpc.shutdown),
        "profile._start_trace": id(ap.profile.__dict__["_start_trace"]),
        "profile.export_chrome_trace": id(ap.profile.__dict__["export_chrome_trace"]),
        "PyRRef.to_here": id(PyRRef.__dict__["to_here"]), "dist_autograd.backward": id(dist_autograd.backward),
        "DistributedOptimizer.step": id(DistributedOptimizer.__dict__["step"]),
    }
"""

SELF_RPC = r"""
def add(t, n):
    return t + n

def self_rpc(tmp):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp}/init")
    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=opts)
    value = rpc.rpc_sync("worker0", add, args=(torch.ones(2), 1)).tolist()
    rpc.shutdown()
    return value
"""


def _python(code: str, tmp_path: Path, argv: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=clean_env(RPC_OBSERVE_DIR=str(tmp_path / "out"), **env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_unset_patches_nothing_and_imports_nothing(tmp_path):
    code = (
        SNAPSHOT
        + SELF_RPC
        + r"""
before = snapshot()
patched = [n for n, obj in [("_invoke_rpc", api._invoke_rpc), ("_run_function", internal._run_function),
                            ("init_rpc", rpc.init_rpc)] if hasattr(obj, "__rpc_observe_original__")]
value = self_rpc(sys.argv[1] if len(sys.argv) > 1 else ".")
print(json.dumps({"patched": patched, "same": before == snapshot(), "loaded": "rpc_observe" in sys.modules,
                  "value": value}))
"""
    )
    for value in (None, "0", "false"):
        env = {"RPC_OBSERVE": value} if value is not None else {}
        proc = _python(code, tmp_path, **env)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result == {"patched": [], "same": True, "loaded": False, "value": [2.0, 2.0]}
        assert not (tmp_path / "out").exists()


def test_set_patches_on_import_of_torch_only(tmp_path):
    proc = _python(
        "import sys; print('torch' in sys.modules, 'opentelemetry' in sys.modules)", tmp_path, RPC_OBSERVE="1"
    )
    assert proc.stdout.split() == ["False", "False"]  # a process that never imports torch pays nothing
    proc = _python(
        "import torch; from torch.distributed.rpc import api, internal; "
        "print(hasattr(api._invoke_rpc, '__rpc_observe_original__'), "
        "hasattr(internal._run_function, '__rpc_observe_original__'), "
        "api.rpc_async is torch.distributed.rpc.rpc_async)",
        tmp_path,
        RPC_OBSERVE="1",
    )
    assert proc.stdout.split() == ["True", "True", "True"], proc.stderr


def test_unknown_value_warns_once_and_stays_off(tmp_path):
    proc = _python(
        "import torch.distributed.rpc as rpc; print(hasattr(rpc.init_rpc, '__rpc_observe_original__'))",
        tmp_path,
        RPC_OBSERVE="maybe",
    )
    assert proc.stdout.strip() == "False"
    assert proc.stderr.count("RPC_OBSERVE='maybe' is not valid") == 1
    assert "0/false/no/off" in proc.stderr


def test_uninstrument_restores_every_original_exactly(tmp_path):
    code = (
        SNAPSHOT
        + SELF_RPC
        + r"""
import threading, rpc_observe
before = snapshot()
threads = [threading.Thread(target=rpc_observe.instrument) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
rpc_observe.instrument()
value = self_rpc(sys.argv[1])
during = snapshot()
rpc_observe.uninstrument(); rpc_observe.uninstrument()
after = snapshot()
changed = sorted(k for k in before if before[k] != during[k])
print(json.dumps({"changed": changed, "restored": before == after, "value": value}))
"""
    )
    proc = _python(code, tmp_path, argv=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["restored"] is True and result["value"] == [2.0, 2.0]
    assert result["changed"] == sorted(
        [
            "PyRRef.to_here",
            "dist_autograd.backward",
            "DistributedOptimizer.step",
            "api._invoke_rpc",
            "api.remote",
            "rpc.remote",
            "internal._run_function",
            "pickler.serialize",
            "pickler.deserialize",
            "rpc.init_rpc",
            "api.shutdown",
            "rpc.shutdown",
            "profile._start_trace",
            "profile.export_chrome_trace",
        ]
    )  # rpc_sync and rpc_async are never replaced
    spans = list((tmp_path / "out" / "spans").glob("*.jsonl"))
    assert spans and "rpc_sync#add(worker0 -> worker0)" in spans[0].read_text()


def test_instrument_after_init_rpc_warns_and_observes_the_client(tmp_path):
    code = (
        SNAPSHOT
        + SELF_RPC.replace(
            "value = rpc.rpc_sync", "import rpc_observe; rpc_observe.instrument()\n    value = rpc.rpc_sync"
        )
        + r"""
print(json.dumps(self_rpc(sys.argv[1])))
"""
    )
    proc = _python(code, tmp_path, argv=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr
    assert "instrument() was called after init_rpc" in proc.stderr
    text = next((tmp_path / "out" / "spans").glob("*.jsonl")).read_text()
    assert '"kind":3' in text and "rpc_sync#add(worker0 -> worker0)" in text


def test_torch_multiprocessing_spawn_children_are_instrumented(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(r"""
import sys, torch, torch.distributed.rpc as rpc, torch.multiprocessing as mp

def add(t):
    return t + 1

def run(rank, init):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init}"))
    if rank == 0:
        assert rpc.rpc_sync("worker1", add, args=(torch.ones(1),)).item() == 2.0
    rpc.shutdown()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
""")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "init")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=clean_env(RPC_OBSERVE="1", RPC_OBSERVE_DIR=str(tmp_path / "out")),
    )
    assert proc.returncode == 0, proc.stderr
    workers = sorted(p.name.split("-")[0] for p in (tmp_path / "out" / "spans").glob("*.jsonl"))
    assert workers == ["worker0", "worker1"]


def test_unwritable_dir_warns_and_the_job_runs(tmp_path, basic_reference):
    cluster = Cluster(tmp_path, "basic", env={"RPC_OBSERVE": "1", "RPC_OBSERVE_DIR": "/proc/rpc_observe_cannot_write"})
    assert cluster.wait()[0] == basic_reference
    assert "RPC_OBSERVE_DIR='/proc/rpc_observe_cannot_write' is not writable" in cluster.log(0)


@pytest.fixture(scope="module")
def basic_reference(tmp_path_factory):
    return Cluster(tmp_path_factory.mktemp("reference"), "basic", env={"RPC_OBSERVE": "0"}).wait()[0]


def test_opentelemetry_instrument_entry_point():
    (entry,) = [e for e in metadata.entry_points(group="opentelemetry_instrumentor") if e.name == "torch_rpc"]
    instrumentor = entry.load()()
    assert callable(instrumentor.instrument) and callable(instrumentor.uninstrument)


def test_the_wheel_ships_the_startup_hook(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rpc_observe.pth" in names and "rpc_observe/_bootstrap.py" in names
    pth = zipfile.ZipFile(wheel).read("rpc_observe.pth").decode()
    assert pth.startswith("import os;") and "RPC_OBSERVE" in pth


def test_legacy_profiler_events_are_not_recorded_twice(tmp_path):
    code = r"""
import collections, json, sys, torch, torch.distributed.rpc as rpc
def add(t, n):
    return t + n
rpc.init_rpc("worker0", rank=0, world_size=1,
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{sys.argv[1]}/init"))
with torch.autograd.profiler_legacy.profile() as prof:
    rpc.rpc_sync("worker0", add, args=(torch.ones(2), 1))
    rpc.rpc_async("worker0", add, args=(torch.ones(2), 1)).wait()
rpc.shutdown()
print(json.dumps(collections.Counter(e.name for e in prof.function_events if e.name.startswith("rpc_"))))
"""
    counts = []
    for value in ("0", "1"):
        (tmp_path / value).mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / value)],
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env(RPC_OBSERVE=value, RPC_OBSERVE_DIR=str(tmp_path / "out")),
        )
        assert proc.returncode == 0, proc.stderr
        counts.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert counts[0]["rpc_sync#add(worker0 -> worker0)"] == 1
    assert counts[1] == counts[0]  # torch records the key itself; the add-on adds nothing


@pytest.mark.parametrize(
    "change, named",
    [
        ("internal._run_function = lambda udf, extra: None", "internal._run_function takes (udf, extra)"),
        ("del api._invoke_rpc", "api._invoke_rpc AttributeError"),
        ("internal._InternalRPCPickler.deserialize = lambda self, data: None", "deserialize takes (self, data)"),
    ],
)
def test_a_changed_torch_is_left_exactly_as_it_was(tmp_path, change, named):
    """The self-check: a torch whose internals differ gets one warning naming them, and no patch at all."""
    code = (
        SNAPSHOT
        + SELF_RPC
        + f"""
import logging
logging.basicConfig()
{change}
saved = {{n: v for n, v in vars(api).items() if n == "_invoke_rpc"}}
before = snapshot() if "_invoke_rpc" in vars(api) else None
import rpc_observe
rpc_observe.instrument()
after = snapshot() if "_invoke_rpc" in vars(api) else None
if "del api._invoke_rpc" in {change!r}:
    print(json.dumps({{"same": True, "value": None}}))
else:
    print(json.dumps({{"same": before == after, "value": None}}))
"""
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["same"] is True
    warnings = [line for line in proc.stderr.splitlines() if "differs from what rpc_observe hooks" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"torch {torch_version()}" in warnings[0] and "Nothing of torch is patched" in warnings[0]
    assert all(part in warnings[0] for part in named.split(" ")), warnings[0]


def test_a_changed_torch_still_serves_rpcs_unpatched(tmp_path):
    code = (
        SNAPSHOT
        + SELF_RPC
        + """
internal._run_function = (lambda original: lambda udf: original(udf))(internal._run_function)
import rpc_observe
rpc_observe.instrument()
print(json.dumps({"value": self_rpc(sys.argv[1] if len(sys.argv) > 1 else "."),
                  "patched": hasattr(api._invoke_rpc, "__rpc_observe_original__")}))
"""
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"value": [2.0, 2.0], "patched": False}


def torch_version() -> str:
    return metadata.version("torch")
