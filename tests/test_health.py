"""GPU health after a killed probe: the decisions (pure, no GPU), the typed error, the worker's
report on CPU-only machines, and the real check on GPUs (RS_GPU_TESTS=1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from resilient_strategy.core.probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
from resilient_strategy.errors import GpuUnusableError, ResilientStrategyError
from resilient_strategy.probing import health


def spec(devices: tuple[int, ...] = (0, 1), **kw: object) -> ProbeSpec:
    return ProbeSpec("torch:nccl:0,1", "torch", "nccl", devices, world_size=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("s", "r", "wanted"), [
    (spec(), ProbeResult("k", TIMEOUT, 5.0, "timeout"), True),
    (spec(), ProbeResult("k", ERROR, 1.0, "crash"), True),
    (spec(), ProbeResult("k", ERROR, 1.0, "nccl_invalid_usage"), False),  # failed, not killed
    (spec(), ProbeResult("k", OK, 1.0), False),
    (spec(()), ProbeResult("k", TIMEOUT, 5.0, "timeout"), False),  # gloo on CPU processes
    (ProbeSpec("tf", "tensorflow", "hierarchical_copy", (0, 1), logical_cpus=2),
     ProbeResult("k", TIMEOUT, 5.0, "timeout"), False),  # logical CPUs stand in for GPUs
])
def test_only_a_killed_probe_on_real_gpus_needs_a_check(
        s: ProbeSpec, r: ProbeResult, wanted: bool) -> None:
    assert health.needs_check(s, r) is wanted


def report(gpus: dict[str, dict[str, object]], current: int | None = None) -> str:
    return json.dumps({"gpus": gpus, **({"current": current} if current is not None else {})})


def test_the_gpu_a_check_hung_on_is_named() -> None:
    text = report({"0": {"ok": True}}, current=1)
    broken = health.broken_gpus([0, 1, 2], text, timed_out=True, returncode=None)
    assert [i for i, _ in broken] == [1]
    assert "deadline" in broken[0][1]


def test_a_gpu_whose_kernel_failed_is_named_and_the_others_are_not() -> None:
    text = report({"0": {"ok": False, "error": "CUDA error: unspecified launch failure"},
                   "1": {"ok": True}})
    broken = health.broken_gpus([0, 1], text, timed_out=False, returncode=1)
    assert broken == [(0, "CUDA error: unspecified launch failure")]


def test_healthy_and_unknown_reports_blame_nothing() -> None:
    assert health.broken_gpus([0, 1], report({"0": {"ok": True}, "1": {"ok": True}}),
                              timed_out=False, returncode=0) == []
    # no report at all (the framework import itself hung): nothing a GPU can be blamed for
    assert health.broken_gpus([0, 1], "", timed_out=True, returncode=None) == []
    assert health.broken_gpus([0, 1], "{not json", timed_out=False, returncode=1) == []


def test_the_error_names_the_gpu_and_says_reset_or_reboot() -> None:
    err = GpuUnusableError([(1, "did not initialize")], after="the hung probe of x was killed")
    assert isinstance(err, ResilientStrategyError)
    assert err.gpus == ((1, "did not initialize"),)
    text = str(err)
    assert "GPU 1" in text and "--gpu-reset -i" in text and "reboot" in text


def test_check_after_runs_nothing_when_not_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> list[tuple[int, str]]:
        raise AssertionError("no check expected")

    monkeypatch.setattr(health, "run_check", boom)
    health.check_after(spec(), ProbeResult("k", OK), {})


def test_check_after_raises_for_what_the_check_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "run_check", lambda *a, **k: [(0, "hung")])
    with pytest.raises(GpuUnusableError) as err:
        health.check_after(spec(), ProbeResult("k", TIMEOUT, 5.0, "timeout"), {})
    assert err.value.gpus == ((0, "hung"),)


@pytest.mark.slow
def test_a_check_that_cannot_start_blames_every_gpu(tmp_path: Path) -> None:
    broken = health.run_check("torch", [0, 1], {}, python=str(tmp_path / "no-python"))
    assert [i for i, _ in broken] == [0, 1]


@pytest.mark.slow
@pytest.mark.torch
def test_the_worker_reports_per_gpu_on_a_machine_without_them(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    broken = health.run_check("torch", [0], env, python=sys.executable, timeout_s=60.0)
    assert [i for i, _ in broken] == [0]
    assert "sees 0 GPU" in broken[0][1]


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_healthy_gpus_pass() -> None:
    if os.environ.get("RS_GPU_TESTS") != "1":
        pytest.skip("set RS_GPU_TESTS=1 on a machine with CUDA GPUs")
    assert health.run_check("torch", [0], dict(os.environ), timeout_s=60.0) == []
