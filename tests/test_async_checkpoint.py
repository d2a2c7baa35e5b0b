"""Checkpoints that do not stop training (issue 33.4): the step pays for a host copy of the state,
a thread writes it, one write in flight; a resume reads only complete checkpoints, also after a
SIGKILL in the middle of a write (a real process), and resumes exactly; the exit waits for the
write in flight; the sharded path goes through DCP's async_save on a gloo group of its own."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

torch = pytest.importorskip("torch")

from resilient_strategy.core.call.arguments import Arguments, options_from  # noqa: E402
from resilient_strategy.errors import InvalidOptionError, NoSpaceError  # noqa: E402
from resilient_strategy.frameworks import checkpoint_writer as cw  # noqa: E402
from resilient_strategy.frameworks.checkpoint import Checkpointer  # noqa: E402
from resilient_strategy.frameworks.torch import TorchRuntime  # noqa: E402
from resilient_strategy.testing import machine  # noqa: E402

pytestmark = [pytest.mark.torch]
TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
DEADLINE_S = 120


def train(directory: Path, every: int, stop_after: int | None = None,
          asynchronous: bool = True) -> tuple[int, dict[str, Any], Checkpointer]:
    """2 epochs of 8 optimizer steps (a Linear, AdamW), checkpointed every ``every`` steps,
    from the checkpoint in ``directory`` when there is one; stop after ``stop_after`` steps."""
    rt = TorchRuntime("cpu", (), 2, 32, 16, rank=0, local_rank=0, world_size=1, timeout_s=30)
    ckpt = Checkpointer(directory, every_steps=every, asynchronous=asynchronous)
    rt.use_checkpointer(ckpt)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(128, 4, generator=g),
                                          torch.randint(0, 2, (128,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, opt, loader = rt.prepare(model, opt, loader)
    for epoch in range(ckpt.epoch, 2):
        rt.set_epoch(epoch)
        for x, y in loader:
            rt.backward(torch.nn.functional.cross_entropy(model(x), y))
            rt.step(opt)
            if stop_after is not None and rt.optimizer_steps == stop_after:
                return rt.optimizer_steps, {}, ckpt
    return rt.optimizer_steps, {k: v.clone() for k, v in model.state_dict().items()}, ckpt


def _child_killed_mid_write(directory: Path, marker: Path) -> None:
    """In the child: train with checkpoints every 2 steps; the write of step 4 writes half its
    bytes, says so (``marker``) and never ends; training goes on to step 5, then waits for the
    SIGKILL."""
    real_save = torch.save

    def slow_save(obj: Any, fh: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, dict) and obj.get("optimizer_steps") == 4:
            fh.write(b"PK\x03\x04 half a checkpoint")
            fh.flush()
            marker.write_text("in flight")
            threading.Event().wait()  # the write never ends
        real_save(obj, fh, *args, **kwargs)

    torch.save = slow_save
    steps, _, _ = train(directory, every=2, stop_after=5)
    (marker.parent / "trained").write_text(str(steps))  # the step went on past the save
    threading.Event().wait()


def _child_exits_after_a_save(directory: Path) -> None:
    """In the child: the last save's write takes a while; the script ends right after it."""
    real_save = torch.save

    def slow_save(obj: Any, fh: Any, *args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)
        real_save(obj, fh, *args, **kwargs)

    torch.save = slow_save
    _, _, ckpt = train(directory, every=8)  # one save, at the last step; no wait
    assert ckpt.saves[-1].outcome == cw.IN_FLIGHT


def _start(*args: str) -> subprocess.Popen[str]:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_async_checkpoint as t; "
            "from pathlib import Path; getattr(t, sys.argv[2])(*map(Path, sys.argv[3:]))")
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, "-c", code, str(TESTS), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    until = time.monotonic() + deadline(DEADLINE_S)
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > until:
            proc.kill()
            out, _ = proc.communicate(timeout=deadline(DEADLINE_S))
            pytest.fail(f"the child never got to {path.name}: {out[-3000:]}")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_sigkill_during_a_write_resumes_exactly_from_the_previous_checkpoint(
        tmp_path: Path) -> None:
    total, straight, _ = train(tmp_path / "straight", every=2)
    assert total == 8
    directory, marker = tmp_path / "ckpt", tmp_path / "in-flight"
    proc = _start("_child_killed_mid_write", str(directory), str(marker))
    try:
        _wait_for(marker, proc)
        _wait_for(tmp_path / "trained", proc)  # the step did not wait for the write
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=deadline(DEADLINE_S))
    # the half-written step 4 is a temporary file; the newest checkpoint is step 2's, whole
    left = sorted(p.name for p in directory.iterdir())
    assert left[0].startswith(f".tmp-{proc.pid}-") and left[1:] == ["checkpoint.pt"]
    assert torch.load(directory / "checkpoint.pt", weights_only=True)["optimizer_steps"] == 2
    steps, resumed, ckpt = train(directory, every=2)
    assert ckpt.restored_step == 2 and steps == total
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value)
    assert ckpt.wait()
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint.prev.pt",
                                                           "checkpoint.pt"]  # swept


@pytest.mark.slow
def test_the_exit_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    proc = _start("_child_exits_after_a_save", str(tmp_path / "ckpt"))
    out, _ = proc.communicate(timeout=deadline(DEADLINE_S))
    assert proc.returncode == 0, out[-3000:]
    data = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=True)
    assert data["optimizer_steps"] == 8
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["checkpoint.pt"]


def test_a_resume_in_the_same_process_waits_for_the_write(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_save = torch.save

    def held_save(obj: Any, fh: Any, *args: Any, **kwargs: Any) -> None:
        release.wait(DEADLINE_S)
        real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(torch, "save", held_save)
    _, _, first = train(tmp_path, every=3, stop_after=3)
    assert first.saves[-1].outcome == cw.IN_FLIGHT  # the step returned; the write waits
    threading.Timer(0.2, release.set).start()
    _, _, again = train(tmp_path, every=3, stop_after=3)  # restores: waits for step 3's write
    assert again.restored_step == 3 and first.saves[-1].outcome == cw.WRITTEN


def test_a_new_save_waits_for_the_previous_write(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """At most one write in flight: the second save waits for the first (never skips it), and
    records the wait."""
    release = threading.Event()
    real_save = torch.save

    def held_save(obj: Any, fh: Any, *args: Any, **kwargs: Any) -> None:
        release.wait(DEADLINE_S)
        real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(torch, "save", held_save)
    ckpt = Checkpointer(tmp_path, every_steps=1)
    model = torch.nn.Linear(3, 1)
    ckpt.attach(model, None, None, None, 1)
    ckpt.micro_step(boundary=True, stepped=True)
    assert [r.outcome for r in ckpt.saves] == [cw.IN_FLIGHT]
    first = ckpt.stall_s  # the host copy only: the write is the thread's
    assert first == ckpt.saves[0].stall_s > 0
    threading.Timer(0.2, release.set).start()
    ckpt.micro_step(boundary=True, stepped=True)  # waits for step 1's write
    assert ckpt.saves[0].outcome == cw.WRITTEN and ckpt.saves[1].waited_s > 0
    # the goodput's checkpoint stall: every save's, the wait for the previous write included
    assert ckpt.stall_s == first + ckpt.saves[1].stall_s
    assert ckpt.saves[1].stall_s >= ckpt.saves[1].waited_s
    assert ckpt.wait()
    assert [(r.step, r.mode, r.outcome) for r in ckpt.saves] == [(1, "async", "written"),
                                                                 (2, "async", "written")]


def test_the_host_copy_is_a_snapshot_later_steps_cannot_change() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "steps": [1, (2, 3)]}
    buffers: dict[tuple[Any, ...], Any] = {}
    copy, ready = cw.snapshot(state, buffers)
    before = {k: v.clone() for k, v in copy["model"].items()}
    moment = copy["optimizer"]["state"][0]["exp_avg"].clone()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # in place: the parameters and the moments move on
    with torch.no_grad():
        model.weight.add_(1.0)
    assert ready is None  # every copy is done (CPU)
    for k, v in before.items():
        assert torch.equal(copy["model"][k], v)
    assert torch.equal(copy["optimizer"]["state"][0]["exp_avg"], moment)
    assert copy["steps"] == [1, (2, 3)] and copy["steps"] is not state["steps"]
    again, _ = cw.snapshot(state, buffers)  # the next save copies into the same buffers
    assert again["model"]["weight"].data_ptr() == copy["model"]["weight"].data_ptr()


def test_a_copy_too_large_for_the_host_memory_is_written_synchronously(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.machine import host

    monkeypatch.setattr(host, "available_memory", lambda root="/": 1000)
    ckpt = Checkpointer(tmp_path, every_steps=1)
    ckpt.attach(torch.nn.Linear(64, 64), None, None, None, 1)  # 16 KB of weights
    ckpt.micro_step(boundary=True, stepped=True)
    assert [(r.mode, r.reason, r.outcome) for r in ckpt.saves] == [
        ("sync", "host_memory", "written")]


def test_synchronous_checkpoints_are_an_option_and_an_environment_variable(
        tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, every_steps=1, asynchronous=False)
    ckpt.attach(torch.nn.Linear(3, 1), None, None, None, 1)
    ckpt.micro_step(boundary=True, stepped=True)
    assert [(r.mode, r.outcome) for r in ckpt.saves] == [("sync", "written")]
    with pytest.raises(InvalidOptionError):
        Checkpointer(tmp_path, asynchronous="yes")  # type: ignore[arg-type]
    facts = machine(2, nvlink=18)
    base: dict[str, Any] = dict(framework="torch", global_batch_size=64, cache=False)
    assert options_from(facts, {}, Arguments.from_kwargs(**base)).checkpoint_async is True
    off = {"RESILIENT_STRATEGY_CHECKPOINT_ASYNC": "0"}
    assert options_from(facts, off, Arguments.from_kwargs(**base)).checkpoint_async is False
    with pytest.raises(InvalidOptionError) as bad:
        options_from(facts, {"RESILIENT_STRATEGY_CHECKPOINT_ASYNC": "later"},
                     Arguments.from_kwargs(**base))
    assert bad.value.option == "RESILIENT_STRATEGY_CHECKPOINT_ASYNC"


# ----- the sharded path: DCP's async_save ------------------------------------------------------
@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist = pytest.importorskip("torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_checkpoint_is_written_in_the_background_and_resumes(
        one_rank_group: None, tmp_path: Path) -> None:
    from resilient_strategy.frameworks import fsdp, sharded_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fsdp.shard(model, opt, device=torch.device("cpu"), world_size=1,
                            dtype="float32")
    ckpt = Checkpointer(tmp_path, every_steps=1)
    ckpt.attach(model, opt, None, None, 1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.micro_step(boundary=True, stepped=True)
    assert ckpt.wait()
    assert [(r.step, r.mode, r.outcome) for r in ckpt.saves] == [
        (k, "async", "written") for k in (1, 2, 3)]
    assert ckpt._async.group is not None  # the writes' collectives: a group of their own
    assert sharded_checkpoint.latest(tmp_path) == tmp_path / "sharded" / "step-000000003"
    files = [p for p in tmp_path.rglob("*")]
    assert {p.stat().st_mode & 0o777 for p in files if p.is_file()} == {0o600}
    assert {p.stat().st_mode & 0o777 for p in [tmp_path, *files] if p.is_dir()} == {0o700}
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    back = Checkpointer(tmp_path, every_steps=1)
    back.attach(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), None, None, 1)
    assert back.restored_step == 3
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b)


def test_a_failed_sharded_write_is_never_the_newest(one_rank_group: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while DCP writes in the background: the step is removed, ``latest``
    still names the previous one, and the NoSpaceError reaches the training thread."""
    from resilient_strategy.frameworks import fsdp, sharded_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fsdp.shard(model, opt, device=torch.device("cpu"), world_size=1,
                            dtype="float32")
    ckpt = Checkpointer(tmp_path, every_steps=1)
    ckpt.attach(model, opt, None, None, 1)
    ckpt.micro_step(boundary=True, stepped=True)
    assert ckpt.wait()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    ckpt.micro_step(boundary=True, stepped=True)
    with pytest.raises(NoSpaceError):
        ckpt.wait()
    monkeypatch.undo()
    assert ckpt.saves[-1].outcome == cw.FAILED
    assert sharded_checkpoint.latest(tmp_path) == tmp_path / "sharded" / "step-000000001"
    assert not (tmp_path / "sharded" / "step-000000002").exists()
