"""pytest plugin (registered through the ``pytest11`` entry point): fixtures for users' tests.

    def test_fallback(rs_sim):
        sel = rs_sim.simulate(rs_sim.machine(2, name="NVIDIA GeForce RTX 4090"),
                              {"nccl": "timeout"}, framework="torch", global_batch_size=64)
        assert sel.backend != "nccl"
"""

from __future__ import annotations

import types

import pytest

from . import fakes


@pytest.fixture
def rs_sim() -> types.SimpleNamespace:
    """The testing kit: ``machine``, ``gpu``, ``simulate``, ``FakeProber``."""
    return types.SimpleNamespace(
        machine=fakes.machine, gpu=fakes.gpu, simulate=fakes.simulate, FakeProber=fakes.FakeProber
    )
