"""Backend selection and the hardware-free checks every backend must pass."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import graphslot
from graphslot import selection
from graphslot.errors import BackendUnavailableError, UsageError

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENDOR = ("torch.cuda", "torch_musa", "cuda", "cupy", "pycuda")


def _vendor_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"] if node.value.id == "torch" else []
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        for n in names:
            if any(n == v or n.startswith(v + ".") for v in VENDOR):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {n}")
    return found


def test_core_never_imports_a_vendor_library():
    sources = sorted((ROOT / "core").rglob("*.py"))
    assert sources, "core/ has no sources?"
    bad = [hit for p in sources for hit in _vendor_uses(p)]
    assert not bad, "core/ must stay device-neutral:\n" + "\n".join(bad)


def test_the_vendor_check_would_catch_an_import(tmp_path):
    p = ROOT / "core" / "_probe_tmp.py"
    try:
        p.write_text("import torch\nimport torch.cuda\nfrom cuda.bindings import driver\nx = torch.cuda.Stream\n")
        hits = _vendor_uses(p)
    finally:
        p.unlink()
    assert len(hits) == 3


def test_importing_graphslot_loads_no_vendor_module():
    code = ("import sys, graphslot; bad=[m for m in sys.modules if m.split('.')[0] in "
            "('torch_musa','cuda','cupy') or m.startswith('torch.cuda.graphs')]; print(bad); "
            "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_graphslot_loads_no_command_adapter_or_backend():
    """``import graphslot`` is the library: the commands (graphslot.cli, their output
    libraries), the adapters and the backends are loaded only when asked for."""
    code = ("import sys, graphslot; bad=sorted(m for m in sys.modules if m.startswith("
            "('graphslot.cli', 'graphslot.adapters', 'graphslot.backends.')) or "
            "m.split('.')[0] in ('tqdm', 'tabulate')); print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unknown_backend_name_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_BACKEND", "rocm")
    with pytest.raises(UsageError) as e:
        graphslot.get_backend()
    for name in ("auto", "cpu", "cuda", "musa", "rocm"):
        assert name in str(e.value)


@pytest.mark.parametrize("name", selection.BACKENDS)
def test_every_backend_probes_without_hardware(name):
    """Each backend answers usable (None) or says what is missing; none crashes."""
    why = selection.probe(name)
    assert why is None or (isinstance(why, str) and len(why) > 10)


def test_an_unusable_named_backend_says_what_is_missing(monkeypatch):
    unusable = [n for n in selection.BACKENDS if selection.probe(n) is not None]
    if not unusable:
        pytest.skip("every backend is usable on this machine")
    name = unusable[0]
    monkeypatch.setitem(selection._cache, "x", None)  # touch the cache so it is restored
    with pytest.raises(BackendUnavailableError, match=f"the {name} backend was asked for"):
        selection.get_backend(name)


def test_auto_picks_a_usable_backend_and_logs_why(caplog):
    selection._cache.pop("auto", None)
    with caplog.at_level("INFO", logger="graphslot"):
        b = selection.get_backend("auto")
    assert selection.probe(b.name) is None
    assert b.name == next(n for n in selection.BACKENDS if selection.probe(n) is None)
    assert selection.selection_reason(b).startswith(("auto", "GRAPHSLOT_BACKEND"))
    assert selection.get_backend("auto") is b
