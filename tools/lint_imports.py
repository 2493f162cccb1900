"""Check graphslot's import contracts (``[tool.importlinter]`` in pyproject.toml).

import-linter reads a package from the file system, but graphslot's one import package
is spread over three folders (core/, backends/, adapters/; see ``package-dir``). This
copies them into one ``graphslot`` tree, as an install lays them out, in a temporary
folder and runs ``lint-imports`` on it. Extra arguments go to ``lint-imports``.

    python tools/lint_imports.py            # or: tox -e imports
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def stage(dest: Path) -> None:
    """Copy every folder of ``package-dir`` to where its package lives in an install."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs: dict[str, str] = conf["tool"]["setuptools"]["package-dir"]
    for pkg, src in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):  # parents first
        shutil.copytree(ROOT / src, dest.joinpath(*pkg.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def main(argv: list[str]) -> int:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe) if exe.exists() else "lint-imports", "--no-cache",
           str(ROOT / "pyproject.toml"), *argv]
    with tempfile.TemporaryDirectory(prefix="graphslot-imports-") as tmp:
        stage(Path(tmp))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [tmp, *filter(None, [os.environ.get("PYTHONPATH")])]))
        return subprocess.call(cmd, cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
