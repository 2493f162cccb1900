"""The cpu backend's VMM driver: real virtual-memory management on host memory.

The driver model maps one to one onto Linux:

=================  ==========================================================
reserve            ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
create             ``memfd_create`` + ``ftruncate`` + ``posix_fallocate``: the pages
                   are committed at once, as a device allocation is
map                ``mmap(MAP_SHARED|MAP_FIXED)`` of the memfd at the address,
                   still ``PROT_NONE`` until access is granted
set_access         ``mprotect(PROT_READ|PROT_WRITE)``
unmap              ``mmap(PROT_NONE, MAP_FIXED|MAP_ANONYMOUS)`` over the range:
                   the reservation stays, the pages are no longer reachable
release            ``close`` of the memfd: once unmapped, the kernel frees the pages
free               the range goes into a quarantine, still ``PROT_NONE``; it is
                   ``munmap``-ed later (see :class:`Quarantine`)
=================  ==========================================================

Touching an address with nothing mapped raises SIGSEGV, so a stale pointer fails as
loudly here as on a device.

Where the host is kinder than a device, the backend is as strict as the device:

* ``create`` commits its pages (``posix_fallocate`` on the memfd) and fails with a
  :class:`~graphslot.errors.DriverError` named ``ENOMEM`` ("out of memory") when the host
  cannot hold them, instead of promising pages that an OOM kill takes back later. Sizes
  above the memory available to this process (``MemAvailable`` of ``/proc/meminfo`` and
  the headroom of its memory cgroup, less a safety margin of
  ``min(256 MiB, MemTotal / 32)``) are refused before any page is touched, so
  ``create(2**62)`` fails at once; nothing is left behind (the memfd is closed).
* A freed address range is not handed out again at once: it stays reserved and
  inaccessible in a quarantine for a while, so a stale tensor view of it faults instead
  of reading the next owner's bytes.
* The granularity (``GRAPHSLOT_CPU_GRANULARITY``, default the page size) must be a power
  of two from the page size to 1 GiB; anything else is a
  :class:`~graphslot.errors.UsageError` naming the variable and the value.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import deque
from typing import Any

from graphslot.errors import DriverError, UsageError
from graphslot.sizes import format_bytes

__all__ = ["CpuDriver", "Quarantine", "parse_granularity", "PAGE", "GRANULARITY_ENV",
           "MAX_GRANULARITY"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = os.sysconf("SC_PAGE_SIZE")

#: The environment variable that sets the cpu backend's allocation granularity.
GRANULARITY_ENV = "GRAPHSLOT_CPU_GRANULARITY"
#: The largest granularity accepted (sizes and offsets are multiples of it).
MAX_GRANULARITY = 1 << 30
#: No mmap length or file size can reach 2**63 bytes (the kernel's limits are signed).
_MAX_BYTES = (1 << 63) - 1


def _os_error(call: str, err: int | None = None, detail: str = "") -> DriverError:
    err = ctypes.get_errno() if err is None else err
    return DriverError("", call, errno.errorcode.get(err, "EUNKNOWN"), err,
                       detail or os.strerror(err))


def _out_of_memory(call: str, detail: str) -> DriverError:
    return DriverError("", call, "ENOMEM", errno.ENOMEM, f"out of memory: {detail}")


def parse_granularity(value: Any, source: str = GRANULARITY_ENV) -> int:
    """The granularity ``value`` names (an int, or the text of ``$GRAPHSLOT_CPU_GRANULARITY``).

    It must be a power of two from the page size to :data:`MAX_GRANULARITY`; anything
    else raises :class:`~graphslot.errors.UsageError` naming ``source`` and the value.
    """
    want = f"a power of two from the page size {PAGE} to {MAX_GRANULARITY} (1 GiB)"
    shown = f"{source}={value!r}" if source == GRANULARITY_ENV else f"{source} {value!r}"
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            n = int(text, 0) if text.lower().startswith(("0x", "0o", "0b")) else int(text, 10)
        except ValueError:
            raise UsageError(f"{shown} is not an integer; set it to {want} bytes, or unset it "
                             f"for the default ({PAGE})") from None
    elif isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{shown} must be an int, got {type(value).__name__}")
    else:
        n = value
    if n < PAGE or n > MAX_GRANULARITY or n & (n - 1):
        why = ("is not positive" if n <= 0 else "is not a power of two" if n & (n - 1)
               else "is smaller than the page size" if n < PAGE else "is larger than 1 GiB")
        raise UsageError(f"{shown} {why}: the cpu granularity must be {want} bytes")
    return n


def _cgroup_dirs() -> list[str]:
    """The memory cgroup directories (v2 or v1) that limit this process, where readable."""
    dirs: list[str] = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return dirs
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            root = "/sys/fs/cgroup"
        elif "memory" in controllers.split(","):
            root = "/sys/fs/cgroup/memory"
        else:
            continue
        path = path.strip("/")
        # Inside a cgroup namespace the own path may not exist under the mount; walk up
        # to the mount's root, each level can limit.
        parts = path.split("/") if path else []
        for i in range(len(parts), -1, -1):
            d = os.path.join(root, *parts[:i])
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) means no limit


class Quarantine:
    """Freed address ranges, kept reserved and inaccessible before they are given back.

    ``free`` on the cpu backend does not ``munmap`` a range at once: the kernel would
    hand the same addresses to the next ``mmap``, so a stale tensor view of a freed
    reservation would silently read whatever the next owner put there. Instead the range
    (which is ``PROT_NONE`` once everything in it is unmapped, and holds no memory) joins
    this first-in, first-out queue. The rule: the oldest ranges are ``munmap``-ed as soon
    as the queue holds more than ``max_ranges`` ranges or more than ``max_bytes`` bytes
    of address space, but the most recently freed range always stays, so the very next
    reservation never reuses it. :meth:`release` empties the queue (a stale view of a
    released range may then read a new owner's bytes again).
    """

    def __init__(self, max_ranges: int = 256, max_bytes: int = 256 << 30) -> None:
        self.max_ranges, self.max_bytes = max_ranges, max_bytes
        self._ranges: deque[tuple[int, int]] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._ranges)

    @property
    def bytes(self) -> int:
        """Address space held in quarantine now (no physical memory: it is all PROT_NONE)."""
        return self._bytes

    def __contains__(self, va: int) -> bool:
        return any(a <= va < a + n for a, n in self._ranges)

    def add(self, va: int, size: int) -> None:
        # Make room first: should a munmap fail, the new range is not in the queue and
        # its reservation stays live in the ledger (free failed), so both agree.
        while self._ranges and (len(self._ranges) + 1 > self.max_ranges
                                or self._bytes + size > self.max_bytes):
            self._unmap_oldest()
        self._ranges.append((va, size))
        self._bytes += size

    def release(self) -> None:
        while self._ranges:
            self._unmap_oldest()

    def _unmap_oldest(self) -> None:
        va, size = self._ranges.popleft()
        self._bytes -= size
        if _libc.munmap(va, size) != 0:
            raise _os_error("munmap", detail=f"releasing the quarantined range at 0x{va:x}")



class _Memfd:
    """Physical backing: an anonymous memory file."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size



class CpuDriver:
    """The nine raw VMM calls (:class:`graphslot.backend.VmmDriver`) on Linux host memory.

    Args:
        granularity: bytes (a power of two from the page size to 1 GiB); default
            ``$GRAPHSLOT_CPU_GRANULARITY`` or the page size.
    """

    def __init__(self, granularity: int | None = None) -> None:
        if granularity is None:
            env = os.environ.get(GRANULARITY_ENV)
            granularity = PAGE if env is None or not env.strip() else parse_granularity(env)
        else:
            granularity = parse_granularity(granularity, "cpu granularity")
        self._gran = granularity
        #: freed address ranges not yet given back to the kernel (see :class:`Quarantine`).
        self.quarantine = Quarantine()
        self._cgroups = _cgroup_dirs()

    def granularity(self) -> int:
        return self._gran

    def _granularity_bytes(self) -> int:
        return self._gran

    def reserve(self, size: int, alignment: int) -> int:
        align = max(alignment, self._gran)
        span = size + (align - PAGE if align > PAGE else 0)
        if span > _MAX_BYTES:  # ctypes would wrap it modulo 2**64 and reserve too little
            raise DriverError("", "mmap", "ENOMEM", errno.ENOMEM,
                              f"{size} bytes is more address space than a 64-bit process has")
        addr = _libc.mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr == MAP_FAILED or addr is None:
            raise _os_error("mmap")
        start = -(-addr // align) * align
        # Trim the slack so exactly [start, start + size) stays reserved.
        if start > addr:
            _libc.munmap(addr, start - addr)
        tail = addr + span - (start + size)
        if tail > 0:
            _libc.munmap(start + size, tail)
        return start

    def free(self, va: int, size: int) -> None:
        # Everything in the range is unmapped, so it is PROT_NONE and holds no memory;
        # it stays reserved in the quarantine until newer frees push it out.
        self.quarantine.add(va, size)

    def headroom_bytes(self) -> int:
        """Bytes ``create`` may still commit: ``MemAvailable`` and the memory cgroup's
        headroom, whichever is smaller, less a safety margin of ``min(256 MiB, MemTotal/32)``
        (so a create that fits never drives the host into the OOM killer)."""
        free, total = self.mem_info()
        for d in self._cgroups:
            limit = _read_int(os.path.join(d, "memory.max"))
            usage = _read_int(os.path.join(d, "memory.current"))
            if limit is None:  # cgroup v1
                limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
                usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            if limit is not None and usage is not None and limit < (1 << 62):
                free = min(free, limit - usage)
        return max(free - min(256 << 20, total // 32), 0)

    def create(self, size: int) -> Any:
        headroom = self.headroom_bytes()
        if size > headroom:
            raise _out_of_memory("posix_fallocate", f"refused before committing any page, "
                                 f"{size} bytes asked and this host can commit "
                                 f"{format_bytes(headroom, digits=1)} more")
        try:
            fd = os.memfd_create("graphslot", os.MFD_CLOEXEC)
        except OSError as e:
            raise _os_error("memfd_create", e.errno) from None
        call = "ftruncate"
        try:
            os.ftruncate(fd, size)
            call = "posix_fallocate"
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                # A kernel whose shmem cannot fallocate: the pages come when touched.
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
                raise _out_of_memory(call, f"{size} bytes cannot be committed on this host "
                                     f"({os.strerror(e.errno or 0)})") from None
            raise _os_error(call, e.errno) from None
        except BaseException:  # an interrupt mid-fallocate: the memfd goes with it
            os.close(fd)
            raise
        return _Memfd(fd, size)

    def release(self, handle: Any) -> None:
        try:
            os.close(handle.fd)
        except OSError as e:
            raise _os_error("close", e.errno) from None

    def map(self, va: int, size: int, handle: Any) -> None:
        addr = _libc.mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, 0)
        if addr == MAP_FAILED or addr != va:
            raise _os_error("mmap")

    def unmap(self, va: int, size: int) -> None:
        addr = _libc.mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                          -1, 0)
        if addr == MAP_FAILED or addr != va:
            raise _os_error("mmap")

    def set_access(self, va: int, size: int) -> None:
        if _libc.mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            raise _os_error("mprotect")

    def mem_info(self) -> tuple[int, int]:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]

    # -- capture state ----------------------------------------------------------
