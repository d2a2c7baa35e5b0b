"""GPU health after a killed probe: the decisions (pure, no GPU), the typed error, the worker's
report on CPU-only machines, and the real check on GPUs (RS_GPU_TESTS=1)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from resilient_strategy.core.measures.probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
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


# ----- the deferred check (issue 21 item 4): which GPUs need a check when -------------------
HUNG = ProbeResult("k", TIMEOUT, 9.0, "timeout", extra=(("hang", "collective"),))
STRAGGLER = ProbeResult("k", TIMEOUT, 4.0, "timeout", extra=(("hang", "straggler"),))


@pytest.mark.parametrize(("r", "ready"), [
    (ProbeResult("k", OK, 1.0), True),
    (HUNG, True),  # every rank inside collective 1: past its device
    (ProbeResult("k", TIMEOUT, 9.0, "timeout", extra=(("hang", "setup"),)), True),
    (STRAGGLER, False),  # a rank that never arrived: maybe stuck initialising its GPU
    (ProbeResult("k", TIMEOUT, 30.0, "timeout"), False),  # only the deadline cut it
    (ProbeResult("k", ERROR, 1.0, "nccl_error"), False),  # no phases: unknown
    (ProbeResult("k", ERROR, 1.0, "nccl_error", phases=(("device_ready", 0.4),)), True),
])
def test_devices_ready_from_the_result(r: ProbeResult, ready: bool) -> None:
    assert health.devices_ready(r) is ready


def test_the_first_hang_of_a_decision_is_checked_at_once_and_later_ones_deferred() -> None:
    u = health.Unproven()
    # issue 31: a hung variant would run on a wedged GPU next, so the first hang is checked now
    assert u.after_probe(spec((0, 1, 2, 3)), HUNG) == (0, 1, 2, 3) and u.hung_once
    u.checked((0, 1, 2, 3))
    assert u.gpus == set()
    # the second hang is deferred to the final check (issue 21: a check per hang is too dear)
    assert u.after_probe(spec((0, 1, 2, 3)), HUNG) == () and u.gpus == {0, 1, 2, 3}
    # where the check does not fit the probe budget, the first hang is deferred too
    v = health.Unproven()
    assert v.after_probe(spec((0, 1)), HUNG, can_check_now=False) == () and not v.hung_once
    assert v.gpus == {0, 1}


def test_a_killed_probe_leaves_its_gpus_unproven_and_a_passing_one_proves_them() -> None:
    u = health.Unproven(hung_once=True)  # the first-hang check is the test above
    assert u.after_probe(spec((0, 1, 2, 3)), HUNG) == ()  # deferred, not checked now
    assert u.gpus == {0, 1, 2, 3} and u.by == ["torch:nccl:0,1"]
    assert u.after_probe(spec((0, 1)), ProbeResult("k", OK, 2.0)) == ()
    assert u.gpus == {2, 3}
    # a second hang past device-ready on the unproven GPUs is deferred as well
    assert u.after_probe(spec((2, 3)), HUNG) == () and u.gpus == {2, 3}
    # CPU probes never touch the ledger
    assert u.after_probe(spec(()), STRAGGLER) == () and u.gpus == {2, 3}


def test_a_probe_that_fails_before_its_devices_are_ready_on_an_unproven_gpu_is_checked_now() -> None:
    u = health.Unproven(hung_once=True)
    u.after_probe(spec((0, 1)), HUNG)
    # a straggler on GPUs 1 and 2: GPU 1 is a suspect; the kill makes 2 unproven too
    assert u.after_probe(spec((1, 2)), STRAGGLER) == (1, 2)
    # an error without phases on an unproven GPU: its unproven GPU only (nothing was killed)
    assert u.after_probe(spec((0, 3)), ProbeResult("k", ERROR, 1.0, "nccl_error")) == (0,)
    # the same failure on proven GPUs needs no check
    assert health.Unproven(hung_once=True).after_probe(spec((0, 1)), STRAGGLER) == ()
    u.checked((0, 1, 2))
    assert u.gpus == set()


def test_the_final_check_covers_the_chosen_gpus_always_and_the_rest_when_affordable() -> None:
    u = health.Unproven({0, 1, 2, 3})
    assert u.final((0,), affordable=True) == ((0, 1, 2, 3), ())
    assert u.final((0,), affordable=False) == ((0,), (1, 2, 3))
    assert u.final((), affordable=False) == ((), (0, 1, 2, 3))  # a CPU choice


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_the_deferred_check_started_by_the_starter_reports_what_the_worker_found() -> None:
    from resilient_strategy.probing.prober import DeferredHealthProber

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU for torch: the worker names GPU 0 as unusable
    broken = DeferredHealthProber().check_gpus("torch", (0,), env)
    assert [gpu for gpu, _ in broken] == [0]
