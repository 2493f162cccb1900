"""Shared fixtures. The same tests run on whichever backend GRAPHSLOT_BACKEND selects;
when that backend cannot run here, every test that needs it is skipped with the reason."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import graphslot
from graphslot.errors import BackendUnavailableError, UsageError


@pytest.fixture(scope="session")
def backend() -> graphslot.Backend:
    try:
        return graphslot.get_backend()
    except BackendUnavailableError as e:
        pytest.skip(f"selected backend unavailable: {e}")


@pytest.fixture
def clean(backend: graphslot.Backend):
    """Fails the test if it leaves reservations or allocations behind in the ledger."""
    before = backend.ledger.snapshot()
    backend.faults.clear()
    yield backend
    backend.faults.clear()
    after = backend.ledger.snapshot()
    assert after == before, f"ledger leaked: before {before}, after {after}"


@pytest.fixture
def regions(clean):
    """``clean``, skipping backends whose graphs cannot draw their pool from a region."""
    b = clean
    res = b.reserve(b.granularity)
    try:
        b.new_graph(pool_region=(res.va, b.granularity)).release_pool()
    except UsageError as e:
        pytest.skip(f"{b.name}: {e}")
    finally:
        b.free(res)
    return b


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The model-based tests take minutes each where every other test takes seconds: run
    them first, so that with several workers (tox's cpu env) the short tests fill in
    beside them instead of leaving one worker alone with them at the end."""
    items.sort(key=lambda item: 0 if item.path.name == "test_stateful.py" else 1)  # stable


def pytest_collection_finish(session: pytest.Session) -> None:
    """What exists once every test module is imported (torch, hypothesis, pytest's own
    objects: millions) lives for the whole run: keep it out of every garbage collection
    from here on. A stack's build collects garbage once (so reference counts of its
    gradient buffers are exact), and on this many objects each collection took 0.3 s:
    most of the time of the model-based tests, which build hundreds of stacks."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_report_header(config: pytest.Config) -> str:
    import os

    return f"graphslot backend: {os.environ.get('GRAPHSLOT_BACKEND', 'auto')}"


def _load_musa_stubbuild() -> None:
    """Make the MUSA stub-driver builder importable as ``musa_stubbuild`` (tests/ is no
    package, so the MUSA test files import it by this name)."""
    if "musa_stubbuild" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "musa_stubbuild", Path(__file__).parent / "musa_stub" / "stubbuild.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["musa_stubbuild"] = mod
    spec.loader.exec_module(mod)


_load_musa_stubbuild()


# -- the libmusa test double, shared by the MUSA test files --------------------------


@pytest.fixture(scope="session")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the libmusa test double is built (skips without a C compiler)."""
    import musa_stubbuild as sb

    if sb.compiler() is None:
        pytest.skip("gcc is not installed: cannot build the libmusa test double")
    return tmp_path_factory.mktemp("musa_stub")


@pytest.fixture(scope="session")
def stub_path(stub_dir: Path) -> Path:
    import musa_stubbuild as sb

    return sb.build(stub_dir)


@pytest.fixture
def stub(stub_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The loaded test double, reset around the test; GRAPHSLOT_LIBMUSA points at it."""
    import musa_stubbuild as sb
    from graphslot.backends.musa import driver

    monkeypatch.setenv(driver.ENV_LIBMUSA, str(stub_path))
    s = sb.Stub(stub_path)
    s.reset()
    yield s
    s.reset()
