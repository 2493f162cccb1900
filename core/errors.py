"""The one exception hierarchy of graphslot.

Every error says what graphslot was doing when it failed. Errors that come from a
backend's driver also carry the driver's own error name and numeric code, so a
``CUDA_ERROR_OUT_OF_MEMORY (2)`` is never reduced to "something went wrong".
"""

from __future__ import annotations

__all__ = [
    "GraphslotError",
    "BackendUnavailableError",
    "DriverError",
    "InjectedFault",
    "UsageError",
    "IncompatibleError",
    "PoolFullError",
    "BudgetError",
    "StateError",
    "CaptureMismatchError",
    "StreamError",
]


class GraphslotError(Exception):
    """Base class of every error graphslot raises."""


class BackendUnavailableError(GraphslotError):
    """A backend was asked for but cannot run here; the message says what is missing."""


class DriverError(GraphslotError):
    """A driver call failed.

    Attributes:
        op: what graphslot was doing, e.g. ``"map 2097152 bytes at 0x7f00..."``.
        call: the raw driver entry point, e.g. ``"cuMemMap"`` or ``"mmap"``.
        name: the driver's error name, e.g. ``"CUDA_ERROR_INVALID_VALUE"`` or ``"ENOMEM"``.
        code: the driver's numeric error code.
    """

    def __init__(self, op: str, call: str, name: str, code: int, detail: str = "") -> None:
        self.op = op
        self.call = call
        self.name = name
        self.code = code
        self.detail = detail
        msg = f"{op}: {call} failed with {name} ({code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class InjectedFault(DriverError):
    """A failure planted by :class:`graphslot.FaultPlan` to test rollback paths."""


class UsageError(GraphslotError, ValueError):
    """Bad input: a size, an alignment, a handle in the wrong state, a range that does not fit."""


class IncompatibleError(UsageError):
    """A framework version or configuration an adapter cannot serve; the message names what."""


class PoolFullError(UsageError):
    """A graph's capture needed more than its pool region holds."""


class BudgetError(UsageError):
    """A memory budget below the smallest peak any plan reaches.

    Attributes:
        budget_bytes: the budget asked for.
        least_bytes: the smallest peak a plan reaches (as modelled, or as built where the
            model's least plan did not fit once built). From ``GraphedLayers``, that peak
            with room for what the process holds moving between builds (two granules, at
            least a MiB, or 4 MiB where the process's footprint is what is measured): a
            budget of at least this builds.
        least_plan: the plan (a :class:`graphslot.budget.BudgetPlan`) that held
            ``least_bytes`` built, or None where the model refused without building one.
    """

    def __init__(self, message: str, *, budget_bytes: int, least_bytes: int,
                 least_plan: object = None) -> None:
        self.budget_bytes = budget_bytes
        self.least_bytes = least_bytes
        self.least_plan = least_plan
        super().__init__(message)


class StateError(GraphslotError):
    """A call arrived in a state that does not allow it (e.g. backward before forward)."""


class CaptureMismatchError(GraphslotError):
    """What a capture or a replay saw differs from what discovery recorded."""


class StreamError(GraphslotError):
    """Work queued on a stream failed; the stream stays failed, like a sticky device error."""
