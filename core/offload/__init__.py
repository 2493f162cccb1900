"""Graph-safe activation offload through fixed-VA slots.

One :class:`OffloadGroup` holds the saved activations of one graphed unit (a layer).
Its life, and the life of each forward pass through it (a *ticket*), follow one state
enum, :class:`State`, and one transition table, :data:`TRANSITIONS`::

    group:   DISCOVERING --allocate--> ALLOCATED --begin_capture--> CAPTURING --finish_capture--> READY
    ticket:  READY --offload--> HELD --offload--> RELEASED (remap) | RESIDENT_PENDING (resident)
             (the newest forward stays HELD until the engine is next asked for more)
             --restore--> RESTORING --wait_restored--> RESTORED --consumed--> DONE
             HELD --restore--> RESTORING (its own backward came next: nothing is copied)
             READY --offload--> KEPT (kept on the device) [--park--> PARKED] --wait_restored--> RESTORED
             READY --forget--> DONE (a forward that no backward follows)

* Discovery: an eager warm-up records each saved tensor's shape, stride, dtype and device.
* Allocation (outside capture): the slot's place in a *bank* (a fixed-VA region shared by
  the groups of its size class, one forward at a time), and reusable host buffers.
* Capture: each saved tensor is copied device to device into its place in the slot; the
  backward graph records the slot's address. Count, order, shape, stride, dtype, device and
  ``data_ptr() == slot VA`` are checked.
* Sections: a bank's bytes move to and from the host in sections of about
  :data:`SECTION_BYTES`, each with events of its own. Where the backend's graphs hold
  events (``Backend.graph_events``), the forward graph itself waits, before it writes a
  section, for the copy that took the previous occupant's bytes of that section out, and
  records when it has written a section; the backward graph waits, before it reads a
  section, for that section's copy back, and records when it is done with one (at the
  next autograd node). So a copy out starts while the forward still runs, the next
  layer's forward starts while the copy out still runs, and a layer's restore fills its
  bank section by section as the backward before it lets go of them: one bank per size
  class is as fast as two. Elsewhere the same section copies are fenced from the host.
* Forward offload: after the forward replay, a copy stream copies the slot to a host
  buffer section by section. No host synchronisation. The newest forward is *held*: its
  copy is queued by the next forward, a restore of another ticket, the engine's ``wait_idle``
  or ``close``; when its own backward comes first (the last layer of a pass), the
  activations never leave the bank and neither copy runs.
* Resident banks (two per size class, mapped for good) make no driver call in a step.
  Remap banks (one per size class where sections stream, else two) are mapped while
  anything is in flight and unmapped and released once nothing is, on a driver worker
  thread, after the device is done with them.
* Backward restore: a host to device copy into the bank at the same VA, section by
  section in the order the backward graph reads them.

Where a group's activations are between forward and backward is a :class:`Residency`:
:class:`ResidentBanks`, :class:`RemapBanks`, or, for groups that do not offload (mode
off, or layers left on the device), :class:`KeptOnDevice` (in the graph's own memory,
moved to a device buffer of their own while another microbatch's graphs run). The engine
keeps the tickets and decides when; the residency does the copies, fences and pages, and
is all that differs between the modes.

Adapters use :class:`OffloadUnit` (:mod:`.unit`), one per graphed unit with its policy
(keep, offload, recompute), laid out by its own discovery or from a :class:`SavedLayout`
recorded in the framework's forward, and of the engine below it only its construction, ``wait_idle``,
``close`` and what it reports (``mode``, ``stats``, ``offloads``, ``timeline``, its
``backend``, ``worker`` and copy streams): the unit holds the order of engine calls around a unit's capture, its
forward replay (offload, prefetch of the next unit) and its backward replay (restore, look
ahead to the next unit, free). Tickets, states, residencies and groups are the package's
own (an import-linter contract keeps the rest of graphslot off them).

The modules depend one way (an import-linter contract holds it), each importing only
those below it:

* :mod:`.unit` - :class:`OffloadUnit`: the adapters' face.
* :mod:`.engine` - :class:`OffloadEngine`: scheduling only.
* :mod:`.group` - :class:`OffloadGroup`: discovery, slot layout, capture, host buffers.
* :mod:`.residency` - banks, fences, the per-section copies, the residencies.
* :mod:`.tickets` - :class:`Ticket` (one forward pass) and its :class:`Stash`.
* :mod:`.states` (the transition table), :mod:`.saved` (saved-tensor specs and layouts, the rules
  for what is never offloaded, sections) and :mod:`.worker` (:class:`DriverWorker`), which
  import nothing of the package.

A lower module sees the ones above through protocols of its own (``EngineHooks``,
``SlotGroup``, ``GroupHost``), which the engine and the group implement. This package
imports only the interface modules of graphslot (backend, errors, sizes).
"""


from .engine import OffloadEngine
from .saved import (SECTION_BYTES, SavedLayout, SavedTensorSpec, never_offloaded, recording_saved_tensors,
                    same_values, sections_of, state_storages, values_fingerprint, watching_saved_values)
from .states import Mode
from .unit import KEEP, OFFLOAD, POLICIES, RECOMPUTE, OffloadUnit, leaves_on_device, ping_pong_banks
from .worker import EXIT_WAIT_S, DriverWorker

__all__ = [
    "OffloadUnit",
    "leaves_on_device",
    "ping_pong_banks",
    "KEEP",
    "OFFLOAD",
    "RECOMPUTE",
    "POLICIES",
    "OffloadEngine",
    "Mode",
    "SavedLayout",
    "SavedTensorSpec",
    "SECTION_BYTES",
    "sections_of",
    "values_fingerprint",
    "same_values",
    "watching_saved_values",
    "DriverWorker",
    "EXIT_WAIT_S",
    # for graphslot.memory's measurements (the same rule the units apply)
    "never_offloaded",
    "state_storages",
    "recording_saved_tensors",
]
