"""A script's own loop adopted (issue 43.1-43.3): the process group (or a stand-in of one
process) from the decision on, a model with ``.module`` and an optimizer that accumulates on its
own, the global batch checked where it is applied, and a resumed mid-epoch position that a peek
at the loader does not spend. The PyTorch DDP tutorial's torchrun script, adopted in a few lines,
runs for real under torchrun on 2 CPU processes, healthy and with gloo broken."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

torch = pytest.importorskip("torch")

from resilient_strategy.errors import GlobalBatchError, InvalidOptionError  # noqa: E402
from resilient_strategy.frameworks.checkpoint import Checkpointer  # noqa: E402
from resilient_strategy.frameworks.torch import TorchRuntime  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).parents[1]
ADOPTED = ROOT / "examples" / "adopted"


def _runtime(accumulation: int, per_replica: int | None) -> TorchRuntime:
    glob = None if per_replica is None else per_replica * accumulation
    return TorchRuntime("cpu", (), accumulation, glob, per_replica, rank=0, local_rank=0,
                        world_size=1, timeout_s=30)


def _data(n: int) -> Any:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, generator=g),
                                          torch.randn(n, 1, generator=g))


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _own_loop(model: Any, opt: Any, loader: Any, epochs: int) -> int:
    """The tutorial's loop: zero_grad, forward, backward, step; its own samples counted."""
    samples = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            samples += len(x)
    return samples


# ----- the stand-in group and the adopted objects ----------------------------------------------
def test_a_world_of_one_has_a_process_group_for_the_scripts_own_sampler() -> None:
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    rt = _runtime(2, None)
    rt.init(stand_in=True)
    try:
        assert dist.is_initialized() and (dist.get_world_size(), dist.get_rank()) == (1, 0)
        sampler = DistributedSampler(range(10), shuffle=False)  # no num_replicas, no rank
        assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, list(range(10)))
        t = torch.arange(3.0)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        out = [torch.zeros(3)]
        dist.all_gather(out, t + 1)
        objects: list[Any] = [None]
        dist.all_gather_object(objects, {"rank": 0})
        dist.barrier()
        assert t.tolist() == [0, 1, 2] and out[0].tolist() == [1, 2, 3]
        assert objects == [{"rank": 0}]
    finally:
        rt.shutdown()
    assert not dist.is_initialized()  # shutdown ended the stand-in too


def test_the_adopted_loop_accumulates_as_one_batch_of_the_global_size() -> None:
    """Accumulating 2 micro-batches of 4 with the script's own zero_grad/backward/step gives the
    weights of one batch of 8 per step, and as many optimizer steps; an epoch whose micro-batch
    count is odd ends its step on the epoch's last (short) micro-batch."""
    for n in (32, 36):
        ref = _model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ref_steps = [0]
        ref_opt.register_step_post_hook(lambda *a, c=ref_steps: c.__setitem__(0, c[0] + 1))
        ref_loader = torch.utils.data.DataLoader(_data(n), batch_size=8)
        _own_loop(ref, ref_opt, ref_loader, epochs=2)

        rt = _runtime(2, 4)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = [0]
        opt.register_step_post_hook(lambda *a, c=steps: c.__setitem__(0, c[0] + 1))
        loader = torch.utils.data.DataLoader(_data(n), batch_size=4)
        try:
            model, opt = rt.adopt(model, opt, loader)
            assert isinstance(opt, torch.optim.Optimizer)
            samples = _own_loop(model, opt, loader, epochs=2)
        finally:
            rt.shutdown()
        assert steps[0] == ref_steps[0] == rt.optimizer_steps == 2 * -(-n // 8)
        assert samples == 2 * n
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(model.module.state_dict()[key], value)
        assert list(model.state_dict()) == ["module.weight", "module.bias"]  # as DDP names them


def test_without_the_loader_the_short_last_micro_batch_ends_its_step() -> None:
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _own_loop(ref, ref_opt, torch.utils.data.DataLoader(_data(34), batch_size=8), epochs=1)
    rt = _runtime(2, 4)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model, opt = rt.adopt(model, opt)
        _own_loop(model, opt, torch.utils.data.DataLoader(_data(34), batch_size=4), epochs=1)
    finally:
        rt.shutdown()
    assert rt.optimizer_steps == 5  # 4 steps of 8, then the epoch's last micro-batch of 2
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(model.module.state_dict()[key], value)


# ----- the global batch, checked where it is applied -----------------------------------------
def test_a_loader_of_another_batch_is_refused_at_adopt() -> None:
    rt = _runtime(2, 4)
    try:
        with pytest.raises(GlobalBatchError) as err:
            rt.adopt(_model(), torch.optim.SGD(_model().parameters(), lr=0.1),
                     torch.utils.data.DataLoader(_data(32), batch_size=2))
    finally:
        rt.shutdown()
    assert (err.value.step, err.value.expected, err.value.seen) == (0, 4, 2)


@pytest.mark.parametrize(("fed", "step", "seen"), [(2, 1, 2), (8, 0, 8)])
def test_micro_batches_of_another_size_stop_at_the_first_wrong_step(
        fed: int, step: int, seen: int) -> None:
    """Halved micro-batches (the batch of each step halved in silence: issue 43's Accelerate
    case) and doubled ones are one typed error: a doubled one at once, halved ones at the second
    (without the loader, one short micro-batch is the end of an epoch)."""
    rt = _runtime(2, 4)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model, opt = rt.adopt(model, opt)
        with pytest.raises(GlobalBatchError) as err:
            _own_loop(model, opt, torch.utils.data.DataLoader(_data(32), batch_size=fed), 1)
    finally:
        rt.shutdown()
    assert (err.value.step, err.value.expected, err.value.seen) == (step, 4, seen)


def test_adopt_is_refused_on_a_sharded_decision_and_twice() -> None:
    rt = TorchRuntime("cpu", (), 1, None, None, rank=0, local_rank=0, world_size=1,
                      timeout_s=30, sharded=True, offload=True)
    with pytest.raises(InvalidOptionError):
        rt.adopt(_model(), None)
    rt = _runtime(1, None)
    try:
        rt.adopt(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
        with pytest.raises(InvalidOptionError):
            rt.adopt(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    finally:
        rt.shutdown()


def _nanogpt_loop(model: Any, opt: Any, data: Any, micro: int, per_step: int, steps: int) -> None:
    """nanoGPT's loop: ``per_step`` forward/backward passes of ``micro`` samples, each loss
    divided by ``per_step``, then one step and zero_grad."""
    x, y = data.tensors
    at = 0
    for _ in range(steps):
        for _ in range(per_step):
            loss = torch.nn.functional.mse_loss(model(x[at:at + micro]), y[at:at + micro])
            (loss / per_step).backward()
            at += micro
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_loop_that_accumulates_itself_steps_on_every_call_and_each_step_is_checked() -> None:
    """``accumulates=True`` (nanoGPT): the decision accumulates 2 on one process, the loop itself
    4 passes of 4 per step (its accumulation divided by the world size it reads, 1): every step
    applies, with the weights of one 16-sample batch per step; a loop that divides by the
    launcher's WORLD_SIZE (2 passes: 8 samples) is stopped at its first step."""
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _nanogpt_loop(ref, ref_opt, _data(64), 16, 1, 4)
    rt = TorchRuntime("cpu", (), 2, 16, 8, rank=0, local_rank=0, world_size=1, timeout_s=30)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model, opt = rt.adopt(model, opt, accumulates=True)
        _nanogpt_loop(model, opt, _data(64), 4, 4, 4)
    finally:
        rt.shutdown()
    assert rt.optimizer_steps == 4
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(model.module.state_dict()[key], value)

    rt = TorchRuntime("cpu", (), 2, 16, 8, rank=0, local_rank=0, world_size=1, timeout_s=30)
    try:
        model, opt = rt.adopt(_model(), torch.optim.SGD(_model().parameters(), lr=0.1),
                              accumulates=True)
        with pytest.raises(GlobalBatchError) as err:
            _nanogpt_loop(model, opt, _data(64), 4, 2, 4)
    finally:
        rt.shutdown()
    assert (err.value.step, err.value.expected, err.value.seen) == (0, 16, 8)


def test_a_loop_that_accumulates_itself_needs_the_global_batch() -> None:
    rt = _runtime(2, None)
    try:
        with pytest.raises(InvalidOptionError):
            rt.adopt(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), accumulates=True)
    finally:
        rt.shutdown()


# ----- a resume whatever the loop does first --------------------------------------------------
def _checkpointed(directory: Path, n: int, epochs: int, stop_after: int | None = None,
                  peek: bool = False) -> tuple[int, int, dict[str, Any]]:
    """The explicit API with a checkpoint; ``peek``: the tutorial's look at the loader before
    each epoch (``next(iter(loader))`` and ``len(loader)``). Returns the optimizer steps, the
    micro-batches trained in this process and the weights."""
    rt = _runtime(2, 4)
    ckpt = Checkpointer(directory, every_steps=1, asynchronous=False)
    rt.use_checkpointer(ckpt)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(n), batch_size=4, shuffle=True)
    model, opt, loader = rt.prepare(model, opt, loader)
    micro = 0
    for epoch in range(ckpt.epoch, epochs):
        rt.set_epoch(epoch)
        if peek:
            assert len(next(iter(loader))[0]) == 4 and len(loader) > 0
        for x, y in loader:
            rt.backward(torch.nn.functional.mse_loss(model(x), y))
            rt.step(opt)
            micro += 1
            if stop_after is not None and rt.optimizer_steps == stop_after:
                return rt.optimizer_steps, micro, {}
    return rt.optimizer_steps, micro, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_peek_before_the_epoch_keeps_the_resumed_position(tmp_path: Path) -> None:
    """Issue 43.3: the tutorial's ``next(iter(loader))`` before each epoch spent the resumed
    position, and the epoch was replayed from its start (more steps than the uninterrupted
    run). Now the position holds until the loop's real iteration."""
    steps, micro, straight = _checkpointed(tmp_path / "straight", 40, 2, peek=True)
    assert (steps, micro) == (10, 20)
    _checkpointed(tmp_path / "ckpt", 40, 2, stop_after=3, peek=True)  # the fault: mid-epoch
    resumed, micro_after, weights = _checkpointed(tmp_path / "ckpt", 40, 2, peek=True)
    assert (resumed, micro_after) == (10, 20 - 6)  # not one micro-batch redone
    for key, value in straight.items():
        torch.testing.assert_close(weights[key], value)


# ----- the tutorial, adopted ----------------------------------------------------------------
def _code(path: Path) -> list[str]:
    """The script's lines after its module docstring."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3:].splitlines()


def test_the_tutorial_adopts_in_four_changed_lines() -> None:
    original, adopted = _code(ADOPTED / "ddp_tutorial_original.py"), _code(ADOPTED / "ddp_tutorial.py")
    diff = [d for d in difflib.ndiff(original, adopted) if d[:2] in ("+ ", "- ")]
    added = [d[2:].strip() for d in diff if d.startswith("+ ")]
    removed = [d[2:].strip() for d in diff if d.startswith("- ")]
    assert (len(added), len(removed)) == (4, 2)  # the docs page says these numbers
    kept = "\n".join(adopted)
    for own in ("sampler=DistributedSampler(dataset)", "self.optimizer.zero_grad()",
                "loss.backward()", "self.optimizer.step()", "self.model.module.state_dict()",
                "destroy_process_group()", "next(iter(self.train_data))"):
        assert own in kept


def _torchrun(script: str, out: Path, samples: int, **env: str) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    environ = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
               "RESILIENT_STRATEGY_CACHE_DIR": str(out / "cache"), "CUDA_VISIBLE_DEVICES": "",
               **env}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", str(ADOPTED / script), "2", "1", "--batch_size", "16", "--samples",
            str(samples), "--report", str(out)]
    return subprocess.run(argv, cwd=out, env=environ, capture_output=True, text=True,
                          timeout=deadline(300))


def _reports(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.slow
def test_the_adopted_tutorial_trains_the_same_steps_healthy_and_with_gloo_broken(
        tmp_path: Path) -> None:
    """264 samples, 16 per rank: 9 optimizer steps per epoch on 2 processes (the last of 8
    samples); with gloo broken, one process trains 17 micro-batches per epoch as the same 9
    steps (two micro-batches each, the epoch's last alone), every sample once per epoch, and
    ends with the weights of the 2-process run; rank 1 leaves at start-up."""
    healthy = _torchrun("ddp_tutorial.py", tmp_path / "healthy", 264)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    two = _reports(tmp_path / "healthy")
    assert sorted(two) == [0, 1]
    assert [(r["world"], r["steps"], r["samples"]) for r in two.values()] == [(2, 18, 264)] * 2

    broken = {"GLOO_SOCKET_IFNAME": "nonexistent"}
    fallback = _torchrun("ddp_tutorial.py", tmp_path / "broken", 264, **broken)
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    one = _reports(tmp_path / "broken")
    assert sorted(one) == [0]  # rank 1 exited cleanly before training
    assert (one[0]["world"], one[0]["steps"], one[0]["samples"]) == (1, 18, 2 * 264)
    for key, value in two[0]["weights"].items():
        torch.testing.assert_close(torch.tensor(one[0]["weights"][key]), torch.tensor(value))

    # the tutorial as written dies there (its own init_process_group over the broken gloo)
    original = _torchrun("ddp_tutorial_original.py", tmp_path / "original", 264, **broken)
    assert original.returncode != 0 and not _reports(tmp_path / "original")


@pytest.mark.slow
def test_ddp_skips_the_sync_on_the_micro_steps_that_only_accumulate(tmp_path: Path) -> None:
    """2 processes, a global batch of 32: 2 x 16 per step, or 2 x 8 x 2 accumulated (DDP's sync
    off on the first micro-step of each step): the same optimizer steps and weights, the
    epoch's short last micro-batch (50 samples per rank) included."""
    out = {}
    for per in (16, 8):
        report = tmp_path / f"{per}.json"
        environ = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
                   "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"),
                   "CUDA_VISIBLE_DEVICES": ""}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", str(ROOT / "tests" / "_adopt_accumulate.py"), str(per),
                str(report)]
        done = subprocess.run(argv, cwd=tmp_path, env=environ, capture_output=True, text=True,
                              timeout=deadline(300))
        assert done.returncode == 0, done.stderr[-3000:]
        out[per] = json.loads(report.read_text())
    assert (out[16]["accumulation"], out[8]["accumulation"]) == (1, 2)
    assert out[16]["steps"] == out[8]["steps"] == 8
    assert set(out[16]["syncs"]) == {True}
    assert out[8]["syncs"] == [False, True, False, True, False, True, True] * 2
    torch.testing.assert_close(torch.tensor(out[8]["weight"]), torch.tensor(out[16]["weight"]))
