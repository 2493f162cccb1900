"""The planner's model: a plan's peak memory (:func:`predict_peak_bytes`), its step
(:func:`predict_step_ms`) and the bound no schedule beats (:func:`lower_bound_ms`), as the
package's docstring describes them. Imports the costs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from ..backend import align_up
from ..errors import UsageError
from .costs import (_ALL_CHOICES, KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_CHEAP, RECOMPUTE_PARTS,
                    StackProfile)


@dataclass(frozen=True)
class _Table:
    """A profile's figures by layer, and by choice where they depend on it: what the
    search scores tens of thousands of plans from, without a method call per layer."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    saved: tuple[int, ...]
    work: tuple[int, ...]
    #: what a layer recomputed by parts saves, and its backward's working memory then
    #: (0 where not offered)
    parts_saved: tuple[int, ...]
    parts_work: tuple[int, ...]
    input: tuple[int, ...]
    grad: tuple[int, ...]
    #: ``LayerCost.kept_for(choice, mode)`` by ``(choice, mode == "off")``
    kept: dict[tuple[str, bool], tuple[int, ...]]
    #: ``LayerCost.recompute_for(choice)`` by choice
    recompute: dict[str, tuple[float, ...]]
    grads: int
    forward_ms: float
    backward_ms: float


@functools.lru_cache(maxsize=16)
def _table(profile: StackProfile) -> _Table:
    ls = profile.layers
    return _Table(tuple(c.forward_ms for c in ls), tuple(c.backward_ms for c in ls),
                  tuple(c.saved_bytes for c in ls), tuple(c.work_bytes for c in ls),
                  tuple(c.parts_saved_bytes or 0 for c in ls), tuple(c.parts_work_bytes or 0 for c in ls),
                  tuple(c.input_bytes for c in ls), tuple(c.grad_bytes for c in ls),
                  {(ch, off): tuple(c.kept_for(ch, "off" if off else "remap") for c in ls)
                   for ch in _ALL_CHOICES for off in (False, True)},
                  {ch: tuple(c.recompute_for(ch) for c in ls) for ch in _ALL_CHOICES},
                  sum(c.grad_bytes for c in ls), profile.forward_ms, profile.backward_ms)


def _kept(t: _Table, choices: Sequence[str], mode: str) -> list[int]:
    """What each layer keeps in the graphs' pool (``LayerCost.kept_for``)."""
    off = mode == "off"
    return [t.kept[ch, off][i] for i, ch in enumerate(choices)]


def recompute_ms(profile: StackProfile, choices: Sequence[str]) -> float:
    """The backward time ``choices`` add by recomputing (``LayerCost.recompute_for``)."""
    rec = _table(profile).recompute
    return sum(rec[ch][i] for i, ch in enumerate(choices))


def _check(profile: StackProfile, choices: Sequence[str]) -> None:
    if len(choices) != len(profile.layers):
        raise UsageError(f"{len(choices)} choices for {len(profile.layers)} layers")
    bad = [c for c in choices if c not in _ALL_CHOICES]
    if bad:
        raise UsageError(f"unknown choices {bad}; each is one of {', '.join(_ALL_CHOICES)}")
    no = [i for i, (c, ch) in enumerate(zip(profile.layers, choices))
          if ch == RECOMPUTE_CHEAP and not c.cheap]
    if no:
        raise UsageError(f"layers {no}: {RECOMPUTE_CHEAP} without cheap_saved_bytes and "
                         "cheap_recompute_ms in their profile")
    no = [i for i, (c, ch) in enumerate(zip(profile.layers, choices))
          if ch == RECOMPUTE_PARTS and not c.parts]
    if no:
        raise UsageError(f"layers {no}: {RECOMPUTE_PARTS} without parts_saved_bytes, "
                         "parts_work_bytes and parts_recompute_ms in their profile")
    kept = [i for i, (c, ch) in enumerate(zip(profile.layers, choices)) if c.keep_only and ch != KEEP]
    if kept:
        raise UsageError(f"layers {kept}: their activations stay on the device (keep_only in "
                         "their profile), so they are neither offloaded nor recomputed")


def banks_for(choices: Sequence[str], mode: str) -> int:
    """Staging banks per size class of slots: two in resident, one in remap, none off."""
    if mode == "off" or not any(c in (OFFLOAD, RECOMPUTE, RECOMPUTE_PARTS) for c in choices):
        return 0
    return 2 if mode == "resident" else 1


def slot_bytes(profile: StackProfile, choices: Sequence[str], mode: str) -> list[int]:
    """What each layer puts in a slot (0: nothing leaves the device). An offloaded layer's
    saved activations; a recomputed layer's input when the mode offloads (its forward
    saves nothing else, and its input buffer then goes back to the graphs' pool); what
    a layer recomputed by parts saves, when the mode offloads."""
    if mode == "off":
        return [0] * len(choices)
    t = _table(profile)
    return [t.saved[i] if ch == OFFLOAD else t.input[i] if ch == RECOMPUTE
            else t.parts_saved[i] if ch == RECOMPUTE_PARTS else 0
            for i, ch in enumerate(choices)]


def _classes(profile: StackProfile, slots: Sequence[int]) -> dict[int, list[int]]:
    """Offloading layers by size class (their slot rounded to the granularity), in order."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(slots):
        if n:
            out.setdefault(align_up(n, profile.granularity), []).append(i)
    return out


def banks_bytes(profile: StackProfile, choices: Sequence[str], mode: str) -> int:
    """Device memory of the staging banks ``choices`` need in ``mode``: each size class of
    slots has its own banks."""
    classes = _classes(profile, slot_bytes(profile, choices, mode))
    return banks_for(choices, mode) * sum(classes)


def _boundaries_held(profile: StackProfile, slots: Sequence[int]) -> int:
    """Bytes of the stack's boundary buffers the graphs hold for good: the input of each
    layer and the last one's output, except where the layers on both sides put what they
    save in slots (nothing then reads the buffer after the forward graph that reads it)."""
    n = len(slots)
    inputs = _table(profile).input
    held = 0 if slots[0] else inputs[0]  # the stack's input: its reader decides
    held += 0 if slots[n - 1] else inputs[n - 1]  # the stack's output: its writer decides
    for k in range(1, n):
        if not (slots[k - 1] and slots[k]):
            held += inputs[k]
    return held


def predict_peak_bytes(profile: StackProfile, choices: Sequence[str], mode: str = "remap") -> int:
    """The step's peak device memory under ``choices`` (see the module docstring)."""
    _check(profile, choices)
    slots = slot_bytes(profile, choices, mode)
    return _peak(profile, choices, mode, slots, _classes(profile, slots))


def _peak(profile: StackProfile, choices: Sequence[str], mode: str, slots: Sequence[int],
          classes: dict[int, list[int]]) -> int:
    # The graphs' pool, as the backward graphs are captured (last layer first): at layer
    # i's, what the forwards of layers up to i keep is still live, that of the layers above
    # is free again (their backward graphs, replayed before, are done with it) and holds
    # their gradient buffers, and layer i's backward needs its working memory (and, if
    # recomputed, its activations again). A recomputed layer keeps only its input, in its
    # boundary buffer (counted with the boundaries).
    # Before them, each forward capture: an offloaded layer's activations are made in the
    # pool beside what the layers before it keep, then copied to its slot.
    # Where the stack gives the gradients homes of their own (see gradient_homes), they
    # sit outside the pool for good and the pool holds none.
    t = _table(profile)
    kept = _kept(t, choices, mode)
    homes = gradient_homes(sum(kept), t.grads, profile.keep_grads)
    saved, work, grad = t.saved, t.work, t.grad
    kept_below = 0
    grads_above = 0 if homes else t.grads
    pool = 0
    for i, ch in enumerate(choices):
        k = kept[i]
        kept_below += k
        if ch == OFFLOAD:  # (elsewhere the forward's figure is below the backward's)
            v = kept_below + saved[i]
            if v > pool:
                pool = v
        # (by parts, the backward holds one part's activations again at a time)
        v = kept_below + grads_above + (t.parts_work if ch == RECOMPUTE_PARTS else work)[i]
        if ch == RECOMPUTE or ch == RECOMPUTE_CHEAP:
            v += saved[i] - k
        if v > pool:
            pool = v
        if not homes:
            grads_above -= grad[i]
    return (profile.fixed_bytes + pool + (t.grads if homes else 0)
            + banks_for(choices, mode) * sum(classes) + _boundaries_held(profile, slots))


def has_gradient_homes(profile: StackProfile, choices: Sequence[str], mode: str) -> bool:
    """Does the stack give its gradients homes under ``choices`` in ``mode``
    (:func:`gradient_homes`, from what the model says the layers keep in the graphs' pool)?
    A planned build decides by this, so that it holds what the model counted."""
    t = _table(profile)
    return gradient_homes(sum(_kept(t, choices, mode)), t.grads, profile.keep_grads)


def gradient_homes(kept_bytes: int, grad_bytes: int, keep_grads: bool = False) -> bool:
    """Does a stack give its parameters' gradients homes outside the graphs' pool (one
    address each for good, the backward graphs adding into them, so a kept or accumulated
    ``.grad`` is the only copy)? Pool gradient buffers share memory with what the layers
    keep in the pool (``kept_bytes``), so with ``.grad`` set to None they save up to that
    much over homes; with ``.grad`` kept they cost a whole copy of the gradients more.
    Homes, then, where the training loop keeps ``.grad`` through the next forward
    (``keep_grads``), and where the layers keep at most a sixteenth of the gradients'
    bytes."""
    return keep_grads or 16 * kept_bytes <= grad_bytes


def _copied(profile: StackProfile, choices: Sequence[str], mode: str
            ) -> tuple[list[int], dict[int, list[int]], set[int], set[int]]:  # (Copied)
    """Each layer's slot bytes, the offloading layers by size class, the layer whose bytes
    never go out (the newest forward stays in its bank) and those that need no copy back
    (nothing wrote their bank again before their backward)."""
    slots = slot_bytes(profile, choices, mode)
    classes = _classes(profile, slots)
    off = [i for i, n in enumerate(slots) if n]
    held = set(off[-1:])
    nbanks = banks_for(choices, mode)
    in_place = {i for members in classes.values() for i in members[-nbanks:]} if nbanks else set()
    return slots, classes, held, in_place


def lower_bound_ms(profile: StackProfile, choices: Sequence[str], mode: str = "remap") -> float:
    """``max(T_f, V_out/β_d2h) + max(T_b + T_r, V_in/β_h2d)``: compute and copies each way
    overlapping perfectly, with ``V`` the bytes the plan copies out and back."""
    _check(profile, choices)
    return _bound(profile, choices, _copied(profile, choices, mode))


Copied = tuple[list[int], dict[int, list[int]], set[int], set[int]]


def _bound(profile: StackProfile, choices: Sequence[str], copied: Copied) -> float:
    slots, _, held, in_place = copied
    total = sum(slots)
    out = total - sum(slots[i] for i in held)
    back = total - sum(slots[i] for i in in_place)
    t = _table(profile)
    return bound_ms(t.forward_ms, t.backward_ms, recompute_ms(profile, choices), out, back,
                    profile.d2h_gbps, profile.h2d_gbps)


def bound_ms(fwd_ms: float, bwd_ms: float, recompute_ms: float, out_bytes: float,
             back_bytes: float, d2h_gbps: float | None, h2d_gbps: float | None) -> float:
    """``max(T_f, V_out/β_d2h) + max(T_b + T_r, V_in/β_h2d)``: no schedule that copies
    ``out_bytes`` to the host and ``back_bytes`` back, and recomputes ``recompute_ms`` of
    forward, is faster (a link without a figure counts as free)."""
    def ms(n: float, gbps: float | None) -> float:
        return n / (gbps * 1e6) if gbps else 0.0
    return (max(fwd_ms, ms(out_bytes, d2h_gbps))
            + max(bwd_ms + recompute_ms, ms(back_bytes, h2d_gbps)))


def predict_step_ms(profile: StackProfile, choices: Sequence[str], mode: str = "remap") -> float:
    """The forward and backward time under ``choices``, played out layer by layer (see the
    module docstring); never below :func:`lower_bound_ms`."""
    _check(profile, choices)
    copied = _copied(profile, choices, mode)
    return max(_step(profile, choices, mode, copied), _bound(profile, choices, copied))


def score(profile: StackProfile, choices: Sequence[str], mode: str) -> tuple[float, float, int]:
    """:func:`predict_step_ms`, :func:`lower_bound_ms` and :func:`predict_peak_bytes` at
    once (what the search asks of every plan), sharing the work they have in common."""
    _check(profile, choices)
    copied = _copied(profile, choices, mode)
    bound = _bound(profile, choices, copied)
    return (max(_step(profile, choices, mode, copied), bound), bound,
            _peak(profile, choices, mode, copied[0], copied[1]))


def _step(profile: StackProfile, choices: Sequence[str], mode: str, copied: Copied) -> float:
    """:func:`predict_step_ms` before the bound is applied."""
    tab = _table(profile)
    forward, backward, recompute = tab.forward, tab.backward, tab.recompute
    slots, classes, held, in_place = copied
    if not classes:  # nothing leaves the device: compute alone
        return tab.forward_ms + tab.backward_ms + recompute_ms(profile, choices)
    nbanks = max(1, banks_for(choices, mode))
    d2h = profile.d2h_gbps * 1e6  # bytes per ms
    h2d = profile.h2d_gbps * 1e6
    section = profile.section_bytes
    # Within a size class the banks alternate in backward order; ``prev[i]``: the layer
    # that used i's bank before it, ``nxt[i]``: the one after it.
    banked: set[int] = set()
    prev: dict[int, int] = {}
    nxt: dict[int, int] = {}
    for members in classes.values():
        banked.update(members)
        for k in range(nbanks, len(members)):
            prev[members[k]] = members[k - nbanks]
            nxt[members[k - nbanks]] = members[k]

    # Forward: a layer writes its bank once the bank's last occupant has gone out (section
    # by section: it ends one section after that copy), and copies what it saves into its
    # slot as it runs.
    d2d = profile.d2d_gbps * 1e6 if profile.d2d_gbps else None
    t = 0.0
    d2h_free = 0.0
    out_done: dict[int, float] = {}
    for i in range(len(choices)):
        if i not in banked:
            t += forward[i]
            continue
        start = t
        end = start + forward[i] + (slots[i] / d2d if d2d else 0.0)
        first_out = min(slots[i], section) / d2h  # (one section's copy out)
        if i in prev:
            end = max(end, out_done.get(prev[i], 0.0) + first_out)
        if i not in held:  # sections leave as they are written
            cend = max(d2h_free, start) + slots[i] / d2h
            if choices[i] != RECOMPUTE:  # (a recomputed layer's slot is its input,
                cend = max(cend, end + first_out)  # there from its start)
            d2h_free = out_done[i] = cend
        t = end
    # Backward: an offloaded layer's restore is queued once the backward of the offloading
    # layer above it has begun, and fills its bank as the bank's occupant (the next layer
    # of its class, with one bank) lets go of it; a layer's backward waits for its bytes.
    h2d_free = t
    bwd_start: dict[int, float] = {}
    bwd_end: dict[int, float] = {}
    above: int | None = None  # the offloading layer above, in backward order
    for i in reversed(range(len(choices))):
        if i not in banked:
            t += backward[i] + recompute[choices[i]][i]
            continue
        ready = t
        if i not in in_place:
            queued = bwd_start[above] if above is not None else t
            # (a recomputed layer reads its input first, for the recompute: it lets go of
            # its bank as its backward begins; an offloaded one as its backward ends)
            freed = queued if i not in nxt else (
                bwd_start[nxt[i]] if choices[nxt[i]] == RECOMPUTE else bwd_end[nxt[i]])
            cstart = max(h2d_free, queued, out_done.get(i, 0.0))
            cend = max(cstart + slots[i] / h2d, freed + min(slots[i], section) / h2d)
            h2d_free = cend
            ready = max(t, cend)
        bwd_start[i] = ready
        t = ready + backward[i] + recompute[choices[i]][i]
        bwd_end[i] = t
        above = i
    return t
