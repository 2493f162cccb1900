"""A model-based test: random sequences of what a training loop may do to a GraphedLayers
stack, each step checked bit for bit against the same sequence run eagerly.

Rules: training forwards (up to three in flight), forwards under no_grad, forwards whose
output is dropped, an interrupt between forward and backward, backwards in any order of
the ones in flight, optimizer steps with either zero_grad flavour, and close-and-rebuild
(once per sequence).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.toy import GPTConfig, TinyGPT

# CI runs 125 sequences per mode (250 in all) and 20 per mode with streamed sections;
# GRAPHSLOT_STATEFUL_EXAMPLES=N runs another number.
_EXAMPLES = int(os.environ.get("GRAPHSLOT_STATEFUL_EXAMPLES", "125"))


def _equal(a: torch.Tensor, c: torch.Tensor, what: str) -> None:
    assert torch.equal(a, c), f"{what} differs by {float((a.float() - c.float()).abs().max())}"


class _StackMachine(RuleBasedStateMachine):
    mode = "resident"
    layers = 2

    def __init__(self) -> None:
        super().__init__()
        self.b = graphslot.get_backend()
        c = GPTConfig(hidden=16, heads=2, ffn=32, seq=8, batch=2, layers=self.layers, vocab=32)
        torch.manual_seed(5)
        base = TinyGPT(c).to(self.b.device)
        self.eager, self.graphed = copy.deepcopy(base), copy.deepcopy(base)
        self.sample = base.hidden_in(base.batch(0, self.b.device)[0]).detach().requires_grad_()
        self.stack = self._build()
        self.opt_e = torch.optim.SGD(self.eager.parameters(), lr=0.05, momentum=0.9)
        self.opt_g = torch.optim.SGD(self.graphed.parameters(), lr=0.05, momentum=0.9)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.k = 0
        self.rebuilt = False

    def _stack_kwargs(self) -> dict[str, int]:
        return {"layers_per_graph": 1}  # the engine's work between layers is what is tested

    def _build(self) -> GraphedLayers:
        stack = GraphedLayers(list(self.graphed.blocks), self.sample, mode=self.mode, backend=self.b,
                              **self._stack_kwargs())
        self.graphed.stack = stack
        return stack

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.k += 1
        return self.eager.batch(self.k, self.b.device)

    @precondition(lambda self: len(self.pending) < 3)
    @rule()
    def train_forward(self) -> None:
        data = self._batch()
        le, lg = self.eager(*data), self.graphed(*data)
        _equal(le, lg, "loss")
        self.pending.append((le, lg))

    @rule()
    def no_grad_forward(self) -> None:
        data = self._batch()
        with torch.no_grad():
            _equal(self.eager(*data), self.graphed(*data), "no-grad loss")

    @rule()
    def dropped_forward(self) -> None:
        data = self._batch()
        _equal(self.eager(*data), self.graphed(*data), "dropped loss")

    @rule()
    def interrupted_forward(self) -> None:
        data = self._batch()
        try:
            self.graphed(*data)
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass

    @precondition(lambda self: bool(self.pending))
    @rule(pick=st.integers(0, 2))
    def backward(self, pick: int) -> None:
        le, lg = self.pending.pop(pick % len(self.pending))
        le.backward()
        lg.backward()
        for (name, pe), pg in zip(self.eager.named_parameters(), self.graphed.parameters()):
            assert (pe.grad is None) == (pg.grad is None), name
            if pe.grad is not None:
                _equal(pe.grad, pg.grad, f"grad of {name}")

    @precondition(lambda self: not self.pending)
    @rule(set_to_none=st.booleans())
    def optimizer_step(self, set_to_none: bool) -> None:
        self.opt_e.step()
        self.opt_g.step()
        self.opt_e.zero_grad(set_to_none=set_to_none)
        self.opt_g.zero_grad(set_to_none=set_to_none)
        for (name, pe), pg in zip(self.eager.named_parameters(), self.graphed.parameters()):
            _equal(pe, pg, name)

    # Once per sequence: a build costs more than the rest of a sequence, and a second
    # rebuild tests nothing the first did not.
    @precondition(lambda self: not self.pending and not self.rebuilt)
    @rule()
    def close_and_rebuild(self) -> None:
        self.stack.close()
        self.stack = self._build()
        self.rebuilt = True

    def teardown(self) -> None:
        self.pending.clear()
        self.stack.close()


class _Resident(_StackMachine):
    mode = "resident"


class _Remap(_StackMachine):
    mode = "remap"  # slots of one section: two banks, mapped while a pass is in flight


class _Streamed(_StackMachine):
    """Four layers whose slots move in sections of 1 KiB: the graphs wait for and record
    each section themselves (where the backend's graphs hold events), and remap shares one
    bank between all layers, section by section."""

    layers = 4

    def _stack_kwargs(self) -> dict[str, int]:
        return {"layers_per_graph": 1, "section_bytes": 1024}

    def _build(self) -> GraphedLayers:
        stack = super()._build()
        assert all(len(g.sections) > 1 for g in stack.engine.groups)
        return stack


class _StreamedResident(_Streamed):
    mode = "resident"


class _StreamedRemap(_Streamed):
    mode = "remap"


class _Joined(_StackMachine):
    """Four layers in two graphs of two (``layers_per_graph``): a graph's one slot holds
    what both of its layers save."""

    layers = 4

    def _stack_kwargs(self) -> dict[str, int]:
        return {"layers_per_graph": 2}

    def _build(self) -> GraphedLayers:
        stack = super()._build()
        assert stack.graph_layers == ((0, 1), (2, 3))
        return stack


class _JoinedResident(_Joined):
    mode = "resident"


class _JoinedRemap(_Joined):
    mode = "remap"


_settings = settings(max_examples=_EXAMPLES, stateful_step_count=15, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("machine", [_Resident, _Remap], ids=["resident", "remap"])
def test_random_training_sequences_match_eager(clean, machine):
    machine.TestCase.settings = _settings
    machine.TestCase().runTest()


@pytest.mark.parametrize("machine", [_StreamedResident, _StreamedRemap], ids=["resident", "remap"])
def test_random_training_sequences_match_eager_with_streamed_sections(clean, machine):
    # Fewer sequences than the two above (each stack is twice as deep); CI's time goes there.
    machine.TestCase.settings = settings(_settings, max_examples=max(1, _EXAMPLES // 6))
    machine.TestCase().runTest()


@pytest.mark.parametrize("machine", [_JoinedResident, _JoinedRemap], ids=["resident", "remap"])
def test_random_training_sequences_match_eager_with_joined_layers(clean, machine):
    machine.TestCase.settings = settings(_settings, max_examples=max(1, _EXAMPLES // 6))
    machine.TestCase().runTest()
