"""Shared fixtures. The same tests run on whichever backend GRAPHSLOT_BACKEND selects;
when that backend cannot run here, every test that needs it is skipped with the reason."""

from __future__ import annotations

import pytest

import graphslot
from graphslot.errors import BackendUnavailableError


@pytest.fixture(scope="session")
def backend() -> graphslot.Backend:
    try:
        return graphslot.get_backend()
    except BackendUnavailableError as e:
        pytest.skip(f"selected backend unavailable: {e}")


@pytest.fixture
def clean(backend: graphslot.Backend):
    """Fails the test if it leaves reservations or allocations behind in the ledger."""
    before = backend.ledger.snapshot()
    backend.faults.clear()
    yield backend
    backend.faults.clear()
    after = backend.ledger.snapshot()
    assert after == before, f"ledger leaked: before {before}, after {after}"


def pytest_report_header(config: pytest.Config) -> str:
    import os

    return f"graphslot backend: {os.environ.get('GRAPHSLOT_BACKEND', 'auto')}"
