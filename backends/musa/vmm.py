"""The raw VMM primitives of :class:`~graphslot.backend.Backend`, over a :class:`MusaDriver`.

Kept apart from :mod:`.backend` (which needs torch_musa) so the checked layer can be
run over the driver alone: tests combine this mixin with a host-side backend and a
stub libmusa. The mixin must come before the :class:`Backend` subclass in the bases.
"""

from __future__ import annotations

from typing import Any

from .driver import MusaDriver


class MusaVmm:
    """Implements ``_granularity_bytes``, ``_reserve`` ... ``_mem_info`` via ``self._drv``."""

    _drv: MusaDriver

    def _granularity_bytes(self) -> int:
        return self._drv.granularity()

    def _reserve(self, size: int, alignment: int) -> int:
        return self._drv.reserve(size, alignment)

    def _free(self, va: int, size: int) -> None:
        self._drv.free(va, size)

    def _create(self, size: int) -> Any:
        return self._drv.create(size)

    def _release(self, handle: Any) -> None:
        self._drv.release(handle)

    def _map(self, va: int, size: int, handle: Any) -> None:
        self._drv.map(va, size, handle)

    def _unmap(self, va: int, size: int) -> None:
        self._drv.unmap(va, size)

    def _set_access(self, va: int, size: int) -> None:
        self._drv.set_access(va, size)

    def _mem_info(self) -> tuple[int, int]:
        return self._drv.mem_info()
