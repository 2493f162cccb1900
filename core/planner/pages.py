"""Physical pages shared by parts of one address range that are never live at once:
:func:`share_pages`.

A captured graph's pool cannot move its blocks, but where graphslot maps the pool's
physical memory itself, page by page, two pages of the pool that are never live at the
same time may be backed by one physical page. That is as safe as what the pool's own
allocator does when it hands a freed block's address to a later block, and it recovers
what the allocator's order of allocations left unusable: bytes of its segments that no
later block fitted. Liveness is that of one step, replayed in the order it was recorded
(a block live "for good" is live over every step).

Sharing pages among unions of intervals is a graph colouring; the first-fit orders tried
here are exact where every page is live over one interval (an interval graph, in order
of first use) and good in practice otherwise. :attr:`PageSharing.least_pages` is the
bound no sharing beats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .specs import PlanError, is_int

__all__ = ["PageSharing", "share_pages"]

#: a block's ``end`` for one live for good (over every step)
FOR_GOOD = None


@dataclass(frozen=True)
class PageSharing:
    """Which physical page backs each page of an address range.

    Attributes:
        page_bytes: the page size.
        physical: for each page of the range, from its start, the index of the physical
            page behind it, or -1 for a page that no block ever touches (it needs none).
        physical_pages: how many physical pages the sharing maps.
        least_pages: the most pages live at once: no sharing maps fewer.
    """

    page_bytes: int
    physical: tuple[int, ...]
    physical_pages: int
    least_pages: int

    @property
    def physical_bytes(self) -> int:
        return self.physical_pages * self.page_bytes

    @property
    def least_bytes(self) -> int:
        return self.least_pages * self.page_bytes

    def sharing(self) -> dict[int, list[int]]:
        """The pages of the range behind each physical page, by physical page."""
        out: dict[int, list[int]] = {}
        for page, phys in enumerate(self.physical):
            if phys >= 0:
                out.setdefault(phys, []).append(page)
        return out


def _check(blocks: Sequence[tuple[int, int, int, int | None]], size: int, page_bytes: int) -> None:
    if not is_int(page_bytes) or page_bytes <= 0:
        raise PlanError(f"page_bytes must be a positive integer, got {page_bytes!r}")
    if not is_int(size) or size < 0:
        raise PlanError(f"size must be a non-negative integer, got {size!r}")
    for i, blk in enumerate(blocks):
        if not isinstance(blk, tuple) or len(blk) != 4:
            raise PlanError(f"block #{i}: expected (offset, nbytes, start, end), got {blk!r}")
        off, n, start, end = blk
        if not (is_int(off) and is_int(n) and off >= 0 and n > 0 and off + n <= size):
            raise PlanError(f"block #{i}: offset {off!r} and nbytes {n!r} must be integers "
                            f"with nbytes > 0 inside the range of {size} bytes")
        if not is_int(start) or not (end is FOR_GOOD or (is_int(end) and end > start)):
            raise PlanError(f"block #{i}: live over [{start!r}, {end!r}): start must be an "
                            "integer and end a larger one, or None for good")


def _runs(bits: int) -> Iterable[tuple[int, int]]:
    """The runs of set bits, as ``[lo, hi)``."""
    while bits:
        lo = (bits & -bits).bit_length() - 1
        hi = (~(bits >> lo) & ((bits >> lo) + 1)).bit_length() - 1 + lo
        yield lo, hi
        bits &= ~(((1 << (hi - lo)) - 1) << lo)


def share_pages(blocks: Iterable[tuple[int, int, int, int | None]], size: int,
                page_bytes: int = 2 << 20) -> PageSharing:
    """Back the pages of a ``size``-byte range with as few physical pages as found, two
    pages sharing one only where they are never live at the same time.

    Args:
        blocks: ``(offset, nbytes, start, end)`` per block: its bytes from ``offset`` in
            the range, live over the steps ``[start, end)``; ``end`` None: live for good.
            A page is live while any block touching it is.
        size: the range's bytes.
        page_bytes: the mapping granularity.

    Returns:
        The :class:`PageSharing`.

    Raises:
        PlanError: a block outside the range, a size or a lifetime that is not one.
    """
    blocks = list(blocks)
    _check(blocks, size, page_bytes)
    times = sorted({t for _, _, s, e in blocks for t in (s, e) if t is not FOR_GOOD})
    at = {t: k for k, t in enumerate(times)}
    every = (1 << max(1, len(times))) - 1
    # each page's liveness as a bit set over the step boundaries (bit k: [times[k], times[k+1]))
    live: dict[int, int] = {}
    for off, n, start, end in blocks:
        bits = every if end is FOR_GOOD else (1 << at[end]) - (1 << at[start])
        for page in range(off // page_bytes, (off + n - 1) // page_bytes + 1):
            live[page] = live.get(page, 0) | bits

    # Pages live over the same steps conflict with one another and with the same others:
    # first fit takes them as one group, and a page live over every step (most of a
    # pool whose outputs are kept) shares with nothing, so it is never looked up.
    groups: dict[int, list[int]] = {}
    for page in sorted(live):
        groups.setdefault(live[page], []).append(page)

    def first_fit(order: list[int]) -> tuple[dict[int, int], int]:
        held: list[int] = []  # each physical page's liveness: its pages' union
        open_: list[int] = []  # the physical pages not yet live over every step
        got: dict[int, int] = {}
        for bits in order:
            pages = groups[bits]
            fits: list[int] = []
            if bits != every:
                for k in open_:
                    if not held[k] & bits:
                        fits.append(k)
                        if len(fits) == len(pages):
                            break
            for k in fits:
                held[k] |= bits
            while len(fits) < len(pages):
                fits.append(len(held))
                held.append(bits)
                if bits != every:
                    # (a page live over a bounded span never reaches the last step
                    # boundary's bit, so only a page live for good is ever full)
                    open_.append(fits[-1])
            for page, k in zip(pages, fits):
                got[page] = k
        return got, len(held)

    orders = [
        sorted(groups, key=lambda b: ((b & -b).bit_length(), -b.bit_count())),
        sorted(groups, key=lambda b: (-b.bit_count(), (b & -b).bit_length())),
        sorted(groups, key=lambda b: -b.bit_length()),
    ]
    best: dict[int, int] = {}
    best_n = -1
    for order in orders:
        got, n = first_fit(order)
        if best_n < 0 or n < best_n:
            best, best_n = got, n
    change = [0] * (max(1, len(times)) + 1)  # pages live, as changes per step boundary
    for bits in live.values():
        for lo, hi in _runs(bits):
            change[lo] += 1
            change[hi] -= 1
    most = running = 0
    for c in change:
        running += c
        most = max(most, running)
    npages = -(-size // page_bytes)
    return PageSharing(page_bytes=page_bytes,
                       physical=tuple(best.get(p, -1) for p in range(npages)),
                       physical_pages=max(best_n, 0), least_pages=most if live else 0)
