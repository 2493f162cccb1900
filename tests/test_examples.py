"""Every python example in README.md and docs/*.md runs as written.

Each fenced block that opens with ```python is one example. It runs in a fresh interpreter
of its own, on the cpu backend, from an empty working directory, and must exit 0 without a
traceback on stderr.

An example that needs more than graphslot and the cpu backend says so on the line right
before its fence, as an HTML comment (invisible when the Markdown is rendered)::

    <!-- example: needs cuda, megatron-core -->

Known needs: ``cuda`` (a CUDA device; such an example then runs on the cuda backend),
``megatron-core``, ``transformer-engine`` (those packages importable) and
``memory_budget`` (``GraphedLayers`` takes a ``memory_budget`` argument). An example
whose needs are not met here is skipped with the reason; an unknown need fails the test.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120  #: per example (each imports torch, on a loaded two-core machine too)

_FENCE = re.compile(r"^```python\s*$")
_MARKER = re.compile(r"^<!--\s*example:\s*needs\s+(?P<needs>[^>]*?)\s*-->\s*$")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_cuda() -> bool:
    from graphslot.selection import probe

    return probe("cuda") is None


def _has_memory_budget() -> bool:
    from graphslot.adapters.torch import GraphedLayers

    return "memory_budget" in inspect.signature(GraphedLayers.__init__).parameters


#: each known need: whether it is met here
NEEDS: dict[str, Callable[[], bool]] = {
    "cuda": _has_cuda,
    "megatron-core": lambda: _importable("megatron.core"),
    "transformer-engine": lambda: _importable("transformer_engine"),
    "memory_budget": _has_memory_budget,
}


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  #: of the opening fence, 1-based
    code: str
    needs: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract(path: Path) -> list[Example]:
    """The python examples of one Markdown file, with the needs marked before each."""
    lines = path.read_text().splitlines()
    out: list[Example] = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: a ```python block never closes")
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        needs = tuple(n.strip() for n in marker["needs"].split(",")) if marker else ()
        out.append(Example(path, start + 1, "\n".join(lines[start + 1:j]) + "\n", needs))
        i = j + 1
    return out


EXAMPLES = [ex for path in DOCS for ex in extract(path)]


def test_examples_are_found_and_their_needs_known() -> None:
    # The README's usage examples alone are more than this; a broken extractor finds none.
    assert len([ex for ex in EXAMPLES if ex.path.name == "README.md"]) >= 4, EXAMPLES
    unknown = {f"{ex.id}: {n}" for ex in EXAMPLES for n in ex.needs if n not in NEEDS}
    assert not unknown, f"unknown needs (known: {', '.join(NEEDS)}): {sorted(unknown)}"


def test_extract_reads_fences_and_markers(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```python\nprint(1)\n```\n```bash\nls\n```\n"
                   "<!-- example: needs cuda, megatron-core -->\n```python\nimport x\ny = 2\n```\n")
    got = extract(doc)
    assert [(ex.line, ex.code, ex.needs) for ex in got] == [
        (2, "print(1)\n", ()), (9, "import x\ny = 2\n", ("cuda", "megatron-core"))]


def _missing(example: Example) -> list[str]:
    return [n for n in example.needs if n in NEEDS and not NEEDS[n]()]


def _run(example: Example) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="graphslot-example-") as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(example.code)
        env = {**os.environ, "GRAPHSLOT_BACKEND": "cuda" if "cuda" in example.needs else "cpu"}
        return subprocess.run([sys.executable, str(script)], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)


_runs: dict[str, Future[subprocess.CompletedProcess[str]]] = {}


def _result(example: Example) -> subprocess.CompletedProcess[str]:
    """The example's run. In one pytest process the first call starts every runnable cpu
    example, one per core at a time (most of each is the interpreter importing torch);
    under pytest-xdist the workers spread the examples themselves, so each runs its own."""
    if os.environ.get("PYTEST_XDIST_WORKER") or "cuda" in example.needs:
        return _run(example)  # device examples one at a time: they share one device
    if not _runs:
        pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
        for ex in EXAMPLES:
            if "cuda" not in ex.needs and not _missing(ex):
                _runs[ex.id] = pool.submit(_run, ex)
        pool.shutdown(wait=False)
    return _runs[example.id].result()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda ex: ex.id)
def test_example_runs(example: Example) -> None:
    missing = _missing(example)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    proc = _result(example)
    where = f"{example.id} (exit {proc.returncode})\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, where
    assert "Traceback" not in proc.stderr, where


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS + [ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_links_point_inside_the_repository(path: Path) -> None:
    """Every relative link resolves to a file of the repository; nothing names a path
    outside it."""
    text = path.read_text()
    bad = []
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        dest = (path.parent / target).resolve()
        if not dest.is_relative_to(ROOT) or not dest.exists():
            bad.append(target)
    outside = [m.group(0) for m in re.finditer(r"(?<![\w.])\.\./[\w./-]+", text)
               if not (path.parent / m.group(0)).resolve().is_relative_to(ROOT)]
    assert not bad and not outside, f"{path.name}: links {bad}, paths outside the repository {outside}"
