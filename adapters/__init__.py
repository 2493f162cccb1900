"""Adapters that plug graphslot into training frameworks: :mod:`.torch` (plain PyTorch,
``GraphedLayers``), :mod:`.megatron` (Megatron-Core's local CUDA graphs) and :mod:`.te`
(TransformerEngine's graphed callables with shared variant pools).

Each imports its framework and graphslot's library (the offload unit API, the budget
planner, memory and backend interfaces), never another adapter and never a backend
package (the import contracts in pyproject.toml); the commands import
adapters, nothing in the library does.
"""
