"""Checkpoints: a ResumableSampler gives each optimizer step the same samples at any replica
count, and a restore resumes exactly where the checkpoint was taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_strategy.errors import InvalidOptionError

torch = pytest.importorskip("torch")

from resilient_strategy.frameworks.checkpoint import Checkpointer, resumable_sampler_class  # noqa: E402
from resilient_strategy.frameworks.torch import TorchRuntime  # noqa: E402


def _steps(world: int, per_replica: int, accumulation: int, n: int, skip: int = 0,
           epoch: int = 3) -> list[set[int]]:
    """The set of sample indices of each optimizer step of one epoch."""
    cls = resumable_sampler_class()
    data = list(range(n))
    lists = []
    for rank in range(world):
        s = cls(data, num_replicas=world, rank=rank, shuffle=True, drop_last=False)
        s.set_epoch(epoch)
        s.skip_next(skip)
        expected = len(s)  # what is left of the epoch, until iterated
        lists.append(list(s))
        assert len(lists[-1]) == expected
    micro = [[lst[i:i + per_replica] for i in range(0, len(lst), per_replica)] for lst in lists]
    out = []
    for k in range(0, len(micro[0]), accumulation):
        out.append({i for m in micro for b in m[k:k + accumulation] for i in b})
    return out


def test_same_samples_per_step_at_any_replica_count() -> None:
    two = _steps(2, 16, 1, 256)
    one = _steps(1, 16, 2, 256)
    assert two == one and len(two) == 8
    assert _steps(1, 16, 2, 256, skip=3 * 32) == one[3:]
    assert _steps(2, 16, 1, 256, skip=3 * 32) == two[3:]
    assert set().union(*one) == set(range(256))


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_sampler_never_repeats_a_sample_and_every_rank_runs_as_many_micro_steps(
        drop_last: bool) -> None:
    """Issue 22.3: DistributedSampler's padding repeated samples (how many depends on the
    replica count). Now each sample left of the epoch is drawn once by one rank, the ranks
    draw as many micro-batches (DDP), and a rank that draws one sample more than its share has
    an epoch-final micro-batch of that one filler alone."""
    cls = resumable_sampler_class()
    for world in range(1, 5):
        for micro in range(1, 4):
            for n in range(0, 15):
                for skip in (0, world * micro, 2 * world * micro):
                    samplers = [cls(list(range(n)), num_replicas=world, rank=r, shuffle=True,
                                    drop_last=drop_last, micro_batch=micro)
                                for r in range(world)]
                    for s in samplers:
                        s.set_epoch(1)
                        s.skip_next(skip)
                    left, steps = samplers[0].remaining, samplers[0].micro_steps
                    assert [len(s) for s in samplers] == [len(list(s)) for s in samplers]
                    for s in samplers:
                        s.skip_next(skip)  # iterating took the skip
                    drawn = [list(s) for s in samplers]
                    assert {-(-len(d) // micro) for d in drawn} == {steps}
                    order = samplers[0]._order()[skip: skip + left]
                    real = [d[:len(range(r, left, world))] for r, d in enumerate(drawn)]
                    assert sorted(i for d in real for i in d) == sorted(order)
                    for d, r in zip(drawn, real, strict=True):  # a filler is a batch alone
                        assert len(d) - len(r) in (0, 1)
                        assert len(d) == len(r) or len(r) % micro == 0
                    if drop_last:
                        assert left % (world * micro) == 0 and drawn == real


def _train(tmp: Path, steps_before_crash: int | None, every: int = 2) -> tuple[int, dict[str, torch.Tensor]]:
    rt = TorchRuntime("cpu", (), 2, 32, 16, rank=0, local_rank=0, world_size=1, timeout_s=30)
    ckpt = Checkpointer(tmp, every_steps=every)
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
            if steps_before_crash is not None and rt.optimizer_steps == steps_before_crash:
                ckpt.wait()  # the write of step 6 ended before the crash (what is read below)
                return rt.optimizer_steps, {}
    ckpt.wait()  # as the exit does
    return rt.optimizer_steps, {k: v.clone() for k, v in model.state_dict().items()}


def test_restore_resumes_mid_epoch_without_losing_or_redoing_a_step(tmp_path: Path) -> None:
    total, straight = _train(tmp_path / "a", None)
    assert total == 8  # 2 epochs x 128 samples / 32 per step
    _train(tmp_path / "b", 7)  # crashes after step 7; the checkpoint holds step 6, mid-epoch
    data = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert (data["optimizer_steps"], data["epoch"], data["samples_in_epoch"]) == (6, 1, 64)
    steps, resumed = _train(tmp_path / "b", None)
    assert steps == total
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def test_checkpoint_options_are_checked(tmp_path: Path) -> None:
    for bad in ({"every_steps": 0}, {"every_seconds": -1.0}, {"every_steps": True}):
        with pytest.raises(InvalidOptionError):
            Checkpointer(tmp_path, **bad)  # type: ignore[arg-type]
    rt = TorchRuntime("cpu", (), 1, 16, 16, rank=0, local_rank=0, world_size=1, timeout_s=30)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    rt.prepare(None, None, loader)
    with pytest.raises(InvalidOptionError):
        rt.use_checkpointer(Checkpointer(tmp_path))
