"""What the commands print through: tables (``tabulate``) and the progress bar (``tqdm``,
on a terminal; plain lines elsewhere).

Both are dependencies of the package, imported only
when a command prints a table or a bar. A command checks :func:`missing` before it does
any work, so a missing library is one clear line, never a traceback after a long run.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from typing import Any, Sequence

from ..errors import UsageError

__all__ = ["EXTRA", "missing", "table", "Progress", "bar_wanted", "unwritable"]

#: How to install the commands' output libraries (dependencies of the package, missing only
#: from an install without them).
EXTRA = "tabulate tqdm"


def missing(module: str, what: str, instead: str | None = None) -> str | None:
    """Why ``what`` cannot be printed here, or ``None`` when ``module`` imports.

    Args:
        module: the library, ``"tabulate"`` or ``"tqdm"``.
        what: what needs it, for the message (``"the plan table"``).
        instead: the option that does without it (``"--json"``), for the message.

    Returns:
        ``None``, or one line naming the library and how to install it.
    """
    try:
        importlib.import_module(module)
    except ImportError:
        msg = f"{what} needs {module}, which is not installed; install it with: pip install {EXTRA}"
        return msg + (f", or pass {instead}" if instead else "")
    return None


def _load(module: str, what: str) -> Any:
    why = missing(module, what)
    if why is not None:
        raise UsageError(why)
    return importlib.import_module(module)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], align: str) -> str:
    """``rows`` under ``headers`` as plain text: columns two spaces apart, no trailing blanks.

    Args:
        rows: the cells (written with ``str``; numbers are not reformatted).
        headers: one per column.
        align: one letter per column, ``l`` (left) or ``r`` (right).

    Returns:
        The table, one line per row after the header line.

    Raises:
        UsageError: ``tabulate`` is not installed.
    """
    tabulate = _load("tabulate", "a table")
    cols = tuple({"l": "left", "r": "right"}[a] for a in align)
    text = tabulate.tabulate([[str(c) for c in r] for r in rows], headers=list(headers),
                             tablefmt="plain", disable_numparse=True, colalign=cols)
    return "\n".join(line.rstrip() for line in text.splitlines())


class Progress:
    """Progress on stderr of ``total`` steps, labelled with the step that runs: a bar
    (``tqdm``) on a terminal; elsewhere (a log file, a pipe) a plain line when a new
    configuration starts or half a minute has passed, so a log cut off by a timeout still
    says how far the run got. With ``enabled=False`` it prints nothing and needs nothing.

    Raises:
        UsageError: ``enabled``, stderr is a terminal and ``tqdm`` is not installed.
    """

    #: Seconds between two lines about the same configuration, where stderr is no terminal.
    LINE_EVERY_S = 30.0

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._err = sys.stderr  # (None where the process has no stderr: then nothing)
        shown = enabled and self._err is not None
        self._lines = shown and not bar_wanted()
        self._total, self._done = total, 0
        self._start = self._last = time.monotonic()
        self._said = ""
        if shown and not self._lines:
            tqdm = _load("tqdm", "the progress bar")
            self._bar = tqdm.tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True,
                                  bar_format="{bar:24} {n_fmt}/{total_fmt} {desc}")

    def update(self, label: str, advance: bool = True, line: bool = False) -> None:
        """Show ``label``; count one step done unless ``advance`` is false. As lines, a
        label is printed when it counts nothing, names another configuration, comes a
        while after the last, or ``line`` says so (a result)."""
        self._done += bool(advance)
        if self._lines:
            # (a configuration's name ends at the first ": "; names such as "budget:7GiB"
            # hold a colon of their own. A label that counts nothing marks a start.)
            now, what = time.monotonic(), label.split(": ", 1)[0]
            if (line or not advance or what != self._said
                    or now - self._last >= self.LINE_EVERY_S):
                self._said, self._last = what, now
                print(f"[{self._done}/{self._total}, {now - self._start:.0f} s] {label}",
                      file=self._err, flush=True)
        if self._bar is None:
            return
        self._bar.set_description_str(label, refresh=not advance)
        if advance:
            self._bar.update(1)

    def skip(self, steps: int) -> None:
        """Count ``steps`` as done without running them (a configuration skipped)."""
        self._done += steps
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if self._lines:
            print(f"[{self._done}/{self._total}, {time.monotonic() - self._start:.0f} s] done",
                  file=self._err, flush=True)
        if self._bar is not None:
            self._bar.close()


def bar_wanted() -> bool:
    """Whether progress shows as a bar (stderr is a terminal) rather than as lines."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # (a replaced or closed stderr)
        return False


def unwritable(path: str) -> str | None:
    """Why no file can be written at ``path`` (its folder missing or read-only, a folder
    there, a pipe no one reads), or ``None``, for an option's message. It tries to make
    the file (``access()`` says yes to root where none can be made, as in /proc) without
    truncating one that is there, waiting on a pipe or touching a dangling link's target,
    and removes what it made."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    if os.path.isdir(path):
        return "is a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable"
    existed = os.path.lexists(path)
    if existed and not os.path.exists(path):
        return None  # (a link to a file not made yet: the write makes it)
    flags = os.O_WRONLY | os.O_NONBLOCK | (0 if existed else os.O_CREAT | os.O_EXCL)
    try:
        os.close(os.open(path, flags, 0o644))
    except OSError as e:
        return f"cannot write it ({e.strerror or e})"
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(path)
    return None
