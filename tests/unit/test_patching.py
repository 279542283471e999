"""Patching and restoring attributes (`_patching`), and the post-import hook (`_bootstrap.on_import`),
on throwaway modules and classes: torch is never touched."""

from __future__ import annotations

import importlib
import logging
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rpc_observe import _bootstrap, _patching
from rpc_observe.telemetry import health


def original(x: int) -> int:
    """The original's docstring."""
    return x + 1


def wrapping(tag: str, made: list[Any] | None = None) -> Callable[[Any], Any]:
    """A make_wrapper whose wrapper returns (tag, what the original returned); records each wrapper it makes."""

    def make(orig: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return tag, orig(*args, **kwargs)

        if made is not None:
            made.append(wrapper)
        return wrapper

    return make


@pytest.fixture
def module() -> types.ModuleType:
    mod = types.ModuleType("fake_rpc_api")
    mod.func = original
    mod.other = len
    return mod


@pytest.fixture
def restored() -> Iterator[None]:
    """_patching's own list is emptied by restore_all; make sure a failing test does not leave patches behind."""
    _patching._applied.clear()
    yield
    _patching.restore_all()


# -- _patching ---------------------------------------------------------------------------


def test_patch_and_restore_a_module_attribute(module: types.ModuleType, restored: None) -> None:
    _patching.patch(module, "func", wrapping("w"))
    wrapper = module.func
    assert wrapper is not original and wrapper(1) == ("w", 2)
    assert wrapper.__rpc_observe_original__ is original and wrapper.__wrapped__ is original
    assert (wrapper.__name__, wrapper.__doc__) == ("original", "The original's docstring.")
    assert _patching._applied == [(module, "func", original, wrapper)]
    _patching.restore_all()
    assert module.func is original and module.other is len
    assert _patching._applied == []


def test_patch_and_restore_a_class_attribute(restored: None) -> None:
    class Pickler:
        def serialize(self, obj: Any) -> Any:
            return ("pickled", obj)

    class Custom(Pickler):  # a user's pickler that subclasses torch's: covered by the patch on the base
        pass

    serialize = Pickler.__dict__["serialize"]
    _patching.patch(Pickler, "serialize", wrapping("w"))
    assert Pickler().serialize(3) == ("w", ("pickled", 3))
    assert Custom().serialize(4) == ("w", ("pickled", 4))
    assert "serialize" not in Custom.__dict__
    _patching.restore_all()
    assert Pickler.__dict__["serialize"] is serialize and Custom().serialize(5) == ("pickled", 5)


def test_patching_twice_is_a_no_op(module: types.ModuleType, restored: None) -> None:
    made: list[Any] = []
    _patching.patch(module, "func", wrapping("w", made))
    _patching.patch(module, "func", wrapping("w", made))
    assert len(made) == 1 and module.func is made[0] and module.func(0) == ("w", 1)  # not wrapped twice
    assert len(_patching._applied) == 1
    _patching.restore_all()
    assert module.func is original


def test_share_a_re_export(module: types.ModuleType, restored: None) -> None:
    package = types.ModuleType("fake_rpc")
    package.func = original  # `from .api import func`
    stale = types.ModuleType("stale")
    stale.func = len  # holds something else: not ours to touch
    _patching.patch(module, "func", wrapping("w"))
    _patching.share(package, "func", module, "func")
    _patching.share(stale, "func", module, "func")
    assert package.func is module.func and package.func(1) == ("w", 2)
    assert stale.func is len
    assert [(owner.__name__, name) for owner, name, _, _ in _patching._applied] == [("fake_rpc_api", "func"),
                                                                                   ("fake_rpc", "func")]
    _patching.restore_all()
    assert package.func is original and module.func is original and stale.func is len


def test_a_later_foreign_patch_is_left_alone_with_a_warning(module: types.ModuleType, restored: None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    _patching.patch(module, "func", wrapping("ours"))
    _patching.patch(module, "other", wrapping("ours"))
    ours = module.func

    def foreign(x: int) -> Any:  # e.g. a test's mock.patch, or another instrumentation
        return "foreign", ours(x)

    module.func = foreign
    _patching.restore_all()
    assert module.func is foreign and module.other is len
    assert module.func(1) == ("foreign", ("ours", 2))  # the foreign patch still calls through ours
    assert [r.getMessage() for r in caplog.records] == [
        "rpc_observe: fake_rpc_api.func was patched again by someone else; leaving it"]
    assert _patching._applied == []


def test_a_foreign_patch_on_a_class_is_left_alone(restored: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")

    class Agent:
        def run(self) -> str:
            return "run"

    _patching.patch(Agent, "run", wrapping("ours"))
    Agent.run = lambda self: "foreign"
    _patching.restore_all()
    assert Agent().run() == "foreign"
    assert [r.getMessage() for r in caplog.records] == [
        "rpc_observe: Agent.run was patched again by someone else; leaving it"]


@pytest.mark.xfail(strict=True, reason="_patching.patch reads a class attribute from the class's own __dict__ only: "
                                       "an inherited method is wrapped as None, and restore_all leaves None behind")
def test_patch_an_inherited_method(restored: None) -> None:
    class Base:
        def serialize(self, obj: Any) -> Any:
            return ("pickled", obj)

    class Sub(Base):
        pass

    _patching.patch(Sub, "serialize", wrapping("w"))
    assert Sub().serialize(1) == ("w", ("pickled", 1))
    _patching.restore_all()
    assert "serialize" not in Sub.__dict__ and Sub().serialize(2) == ("pickled", 2)


# -- _bootstrap.on_import ------------------------------------------------------------------------


@pytest.fixture
def new_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Writes a module (or package) that was never imported to tmp_path, on sys.path; returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(source: str = "VALUE = 41\n", package: bool = False, files: dict[str, str] | None = None) -> str:
        name = f"rpcobs_probe_{uuid.uuid4().hex}"
        if package:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text(source)
            for file, text in (files or {}).items():
                (tmp_path / name / file).write_text(text)
        else:
            (tmp_path / f"{name}.py").write_text(source)
        importlib.invalidate_caches()
        names.append(name)
        return name

    yield write
    for name in names:
        _bootstrap.cancel(name)
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def finders(name: str) -> list[Any]:
    return [f for f in sys.meta_path if isinstance(f, _bootstrap._PostImportFinder) and f.name == name]


def test_on_import_fires_right_after_the_module_runs_exactly_once(new_module: Callable[..., str]) -> None:
    name = new_module("VALUE = 41\nimport sys\nSEEN_AT_IMPORT = sys.modules[__name__].__dict__.get('PATCHED')\n")
    seen: list[tuple[Any, int]] = []

    def callback(mod: types.ModuleType) -> None:
        seen.append((mod, mod.VALUE))  # the module has run
        mod.PATCHED = True

    _bootstrap.on_import(name, callback)
    assert seen == [] and len(finders(name)) == 1 and sys.meta_path[0] is finders(name)[0]
    mod = importlib.import_module(name)
    assert seen == [(mod, 41)] and mod.PATCHED is True and mod.SEEN_AT_IMPORT is None
    assert finders(name) == []  # fired once, and gone
    importlib.import_module(name)
    assert len(seen) == 1
    assert health.internal_errors == {}


def test_on_import_of_a_package_keeps_its_submodules_importable(new_module: Callable[..., str]) -> None:
    name = new_module("VALUE = 1\n", package=True, files={"sub.py": "VALUE = 2\n"})
    seen: list[str] = []
    _bootstrap.on_import(name, lambda mod: seen.append(mod.__name__))
    sub = importlib.import_module(f"{name}.sub")
    assert seen == [name] and sub.VALUE == 2 and sys.modules[name].VALUE == 1


def test_on_import_of_a_submodule(new_module: Callable[..., str]) -> None:
    name = new_module("", package=True, files={"rpc.py": "VALUE = 3\n"})
    seen: list[str] = []
    _bootstrap.on_import(f"{name}.rpc", lambda mod: seen.append(mod.__name__))
    importlib.import_module(name)
    assert seen == []  # the parent is not what was asked for
    importlib.import_module(f"{name}.rpc")
    assert seen == [f"{name}.rpc"]


def test_on_import_of_an_imported_module_calls_back_now(new_module: Callable[..., str]) -> None:
    name = new_module()
    mod = importlib.import_module(name)
    seen: list[Any] = []
    _bootstrap.on_import(name, seen.append)
    assert seen == [mod] and finders(name) == []


def test_on_import_again_replaces_the_callback(new_module: Callable[..., str]) -> None:
    name = new_module()
    first: list[Any] = []
    second: list[Any] = []
    _bootstrap.on_import(name, first.append)
    _bootstrap.on_import(name, second.append)
    assert len(finders(name)) == 1
    importlib.import_module(name)
    assert first == [] and len(second) == 1


def test_cancel_removes_the_finder(new_module: Callable[..., str]) -> None:
    name, other = new_module(), new_module()
    seen: list[Any] = []
    _bootstrap.on_import(name, seen.append)
    _bootstrap.on_import(other, seen.append)
    _bootstrap.cancel(name)
    assert finders(name) == [] and len(finders(other)) == 1  # only that name's
    importlib.import_module(name)
    assert seen == []
    _bootstrap.cancel(name)  # nothing to cancel: fine


def test_a_raising_callback_is_counted_and_the_import_succeeds(new_module: Callable[..., str],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    name = new_module()

    def callback(mod: types.ModuleType) -> None:
        raise RuntimeError("patching failed")

    _bootstrap.on_import(name, callback)
    mod = importlib.import_module(name)
    assert mod.VALUE == 41 and sys.modules[name] is mod
    assert health.internal_errors == {"import_hook": 1}
    assert any("internal error in import_hook" in r.getMessage() and r.exc_info and r.exc_info[0] is RuntimeError
               for r in caplog.records)


def test_the_hooked_package_keeps_its_loader_api(new_module: Callable[..., str]) -> None:
    import importlib.resources
    import pkgutil

    name = new_module("VALUE = 1\n", package=True, files={"data.txt": "payload"})
    _bootstrap.on_import(name, lambda mod: None)
    mod = importlib.import_module(name)
    assert mod.__spec__.loader.get_source(name) == "VALUE = 1\n"
    assert pkgutil.get_data(name, "data.txt") == b"payload"
    assert importlib.resources.files(name).joinpath("data.txt").read_text() == "payload"
