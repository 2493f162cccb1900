"""The planner's records: what to place (:class:`TensorSpec`), where it went
(:class:`Plan`), and the error for input that breaks a rule (:class:`PlanError`).

A :class:`TensorSpec` checks its own fields when it is made; the rules that involve
several tensors are checked by :func:`graphslot.planner.plan`. ``is_int`` is the
package's own helper (shared with verification and the slot plans), not public.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from ..errors import UsageError

__all__ = ["PlanError", "TensorSpec", "Plan"]


class PlanError(UsageError):
    """A tensor list or a plan breaks a planner rule; the message names the tensors."""


def is_int(x: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is no size, offset or step)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place.

    Attributes:
        name: unique within a plan.
        size: bytes, > 0.
        start, end: the tensor is live over schedule steps ``[start, end)``; ``end > start``.
        align: the offset must be a multiple of this power of two.
        branch: id of the mutually exclusive alternative the tensor belongs to, or
            ``None`` for a tensor common to all of them. Must be hashable.
        alias_group: tensors with the same (hashable, non-``None``) id are views of one
            storage, placed ``alias_offset`` bytes after a shared group base.
        alias_offset: byte offset inside the alias group, >= 0; 0 without a group.
    """

    name: str
    size: int
    start: int
    end: int
    align: int = 256
    branch: Hashable | None = None
    alias_group: Hashable | None = None
    alias_offset: int = 0

    def __post_init__(self) -> None:
        # Checked here so a TensorSpec that exists is well formed by itself; rules that
        # involve several tensors (names, groups, branches) are checked by plan().
        who = f"tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not is_int(self.size) or self.size <= 0:
            raise PlanError(f"{who}: size must be a positive integer, got {self.size!r}")
        if not is_int(self.start) or not is_int(self.end):
            raise PlanError(f"{who}: start and end must be integers, got "
                            f"{self.start!r} and {self.end!r}")
        if self.end <= self.start:
            raise PlanError(f"{who}: lifetime [{self.start}, {self.end}) is empty; "
                            f"end must be greater than start")
        if not is_int(self.align) or self.align <= 0 or self.align & (self.align - 1):
            raise PlanError(f"{who}: align must be a power of two, got {self.align!r}")
        if not is_int(self.alias_offset) or self.alias_offset < 0:
            raise PlanError(f"{who}: alias_offset must be a non-negative integer, "
                            f"got {self.alias_offset!r}")
        if self.alias_offset and self.alias_group is None:
            raise PlanError(f"{who}: alias_offset {self.alias_offset} needs an alias_group")
        for field_name in ("branch", "alias_group"):
            try:
                hash(getattr(self, field_name))
            except TypeError:
                raise PlanError(f"{who}: {field_name} must be hashable, got "
                                f"{getattr(self, field_name)!r}") from None


@dataclass(frozen=True)
class Plan:
    """Byte offsets for every tensor in one arena of ``arena_bytes``.

    ``lower_bound_bytes`` is :func:`lower_bound` of ``tensors``; ``offsets`` maps each
    tensor name to its offset from the arena base.
    """

    arena_bytes: int
    offsets: dict[str, int]
    lower_bound_bytes: int
    tensors: tuple[TensorSpec, ...]

    @property
    def efficiency(self) -> float:
        """``lower_bound_bytes / arena_bytes``: 1.0 is optimal (and an empty plan)."""
        return self.lower_bound_bytes / self.arena_bytes if self.arena_bytes else 1.0
