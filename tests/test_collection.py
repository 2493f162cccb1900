"""The whole suite collects under every backend name, including one whose device this
machine lacks: tests that need the device skip with the reason instead of failing to
import (``GRAPHSLOT_BACKEND=musa python -m pytest tests`` on a machine without MUSA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphslot.selection import probe

TESTS = Path(__file__).resolve().parent
ABSENT = [name for name in ("cuda", "musa") if probe(name) is not None]


@pytest.mark.skipif(not ABSENT, reason="cuda and musa both run here: nothing absent to collect under")
def test_the_suite_collects_under_a_backend_this_machine_lacks() -> None:
    procs = {}
    for name in ABSENT:  # in parallel: each collection imports torch and every test module
        env = {**os.environ, "GRAPHSLOT_BACKEND": name}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pytest", str(TESTS), "--collect-only", "-q", "-p", "no:cacheprovider"],
            cwd=TESTS.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"GRAPHSLOT_BACKEND={name}: collection failed:\n{out[-4000:]}"
        assert "error" not in out.splitlines()[-1].lower(), out[-4000:]
