"""Builds and drives libmusa_stub.c, the TEST DOUBLE of libmusa used by the musa tests.

Test files load this module by path (it is not a package), build the stub into a
temporary directory with gcc, and point ``GRAPHSLOT_LIBMUSA`` at it. dlopen hands
graphslot's driver layer and :class:`Stub` the same library, so a test can plant a
failure through :class:`Stub` and watch graphslot report it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("libmusa_stub.c")


def compiler() -> str | None:
    """The C compiler to build the stub with (``$CC``, default gcc), if installed."""
    return shutil.which(os.environ.get("CC", "gcc"))


def build(outdir: Path, *defines: str) -> Path:
    """Compile the stub with ``-D<define>`` for each of ``defines``; returns the .so path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc) to build the libmusa test double")
    suffix = "".join("-" + d.lower() for d in defines)
    out = Path(outdir) / f"libmusa_stub{suffix}.so"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-std=c11",
           *[f"-D{d}" for d in defines], "-o", str(out), str(SOURCE), "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"building the libmusa stub failed: {' '.join(cmd)}\n{res.stderr}")
    return out


class Stub:
    """The stub's test-only controls (``stub_*`` exports), typed."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(path))
        lib = self.lib
        lib.stub_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.stub_calls.argtypes = [ctypes.c_char_p]
        lib.stub_set_granularity.argtypes = [ctypes.c_size_t]
        lib.stub_set_total_memory.argtypes = [ctypes.c_size_t]
        lib.stub_layout.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_int]

    def reset(self) -> None:
        self.lib.stub_reset()

    def fail_next(self, name: str, code: int) -> None:
        """The next call of ``name`` returns ``code`` and has no other effect."""
        assert self.lib.stub_fail_next(name.encode(), code) == 0, "stub fail table full"

    def calls(self, name: str) -> int:
        return self.lib.stub_calls(name.encode())

    def set_device_count(self, n: int) -> None:
        self.lib.stub_set_device_count(n)

    def set_vmm_supported(self, on: bool) -> None:
        self.lib.stub_set_vmm_supported(int(on))

    def set_total_memory(self, n: int) -> None:
        self.lib.stub_set_total_memory(n)

    def live(self) -> dict[str, int]:
        return {"reservations": self.lib.stub_live_reservations(),
                "handles": self.lib.stub_live_handles(),
                "mappings": self.lib.stub_live_mappings()}

    def ctx_refs(self, device: int = 0) -> int:
        return self.lib.stub_ctx_refs(device)

    def thread_has_context(self) -> bool:
        return bool(self.lib.stub_thread_has_context())

    def layout(self) -> list[int]:
        buf = (ctypes.c_long * 64)()
        n = self.lib.stub_layout(buf, 64)
        return list(buf[:n])

    @property
    def dlpack_deleter(self) -> int:
        return ctypes.cast(self.lib.stub_dlpack_deleter, ctypes.c_void_p).value or 0

    def dlpack_deletes(self) -> int:
        return self.lib.stub_dlpack_deletes()
