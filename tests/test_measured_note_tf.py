"""The measured step's note under TensorFlow: its optimizer step is the reporter's (fit counts
the steps; TfRuntime has none of its own)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import resilient_strategy.records.measured as measured
from resilient_strategy.testing import machine, simulate


def test_a_keras_measured_note_is_at_the_reporters_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # before: AttributeError 'TfRuntime' object has no attribute 'optimizer_steps' (rank 0 of a
    # Keras job under run, once its step had been measured)
    notes: list[measured.MeasuredNote] = []
    monkeypatch.setattr(measured, "note_measured_here", notes.append)
    sel = dataclasses.replace(simulate(machine(0, torch=None, tensorflow="2.21.0"),
                                       framework="tensorflow", global_batch_size=64),
                              progress=SimpleNamespace(step=35))
    sel._note_measured(0.25)
    assert [(n.candidate, n.step_s, n.at_step) for n in notes] == [(sel.candidate.key, 0.25, 35)]
