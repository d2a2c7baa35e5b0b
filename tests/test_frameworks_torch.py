"""TorchRuntime: DDP over gloo (2 CPU processes) trains exactly like 1 process accumulating."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

import resilient_strategy.frameworks.torch as runtime_module
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.torch import Precision, TorchRuntime, precision_policy

torch = pytest.importorskip("torch")

SRC = Path(runtime_module.__file__).parents[2]  # the package the tests import
N, DIM, CLASSES, MICRO = 64, 8, 4, 4  # samples, features, classes, per-replica micro-batch
EPOCHS, LR = 2, 0.5

# Runs one configuration in a fresh process: `python -c WORKER out rank world init_file tests`.
# Phase 1/2: train with 1 and 2 accumulation steps; phase 3: record the shards of three shuffled
# loaders prepared one after another; phase 4: count DDP's all-reduces through a comm hook.
WORKER = """
import json, sys
sys.path.insert(0, sys.argv[5])
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from resilient_strategy.frameworks.torch import TorchRuntime
from test_frameworks_torch import MICRO, train, train_counting_allreduces

out, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
result = {"weights": {}, "shards": {}}
for acc in (1, 2):
    rt = TorchRuntime("gloo", (), acc, None, MICRO, rank=rank, local_rank=rank,
                      world_size=world, timeout_s=30, init_method=init)
    result["weights"][acc] = train(rt)
# One model and training loader, then a validation loader alone, then a loader already sharded
# by the user: set_epoch must reshuffle all three.
net, _, train_loader = rt.prepare(
    torch.nn.Linear(1, 1), None, DataLoader(torch.arange(16), batch_size=16, shuffle=True))
assert rt.prepare(net)[0] is net  # already DDP: not wrapped twice
_, _, val_loader = rt.prepare(
    None, None, DataLoader(torch.arange(100, 116), batch_size=16, shuffle=True))
data = torch.arange(200, 216)
own = DataLoader(data, batch_size=MICRO,
                 sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True))
assert rt.prepare(None, None, own)[2] is own  # matching sampler and batch: kept as is
loaders = {"train": train_loader, "val": val_loader, "own": own}
result["shards"] = {k: [] for k in loaders}
for epoch in range(2):
    rt.set_epoch(epoch)
    for k, loader in loaders.items():
        result["shards"][k].append([int(i) for batch in loader for i in batch])
result["allreduces"] = train_counting_allreduces(TorchRuntime(
    "gloo", (), 2, None, MICRO, rank=rank, local_rank=rank, world_size=world, timeout_s=30,
    init_method=init))
rt.shutdown()
with open(out, "w") as f:
    json.dump(result, f)
"""


def data() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)
    )


def train(rt: TorchRuntime) -> list[list[float]]:
    """A few epochs of plain SGD through the runtime; returns the final weights as lists."""
    rt.init()
    with rt.scope():
        net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    # The loader asks for the whole global batch; prepare() rebuilds it per replica.
    loader = torch.utils.data.DataLoader(data(), batch_size=MICRO * 8, shuffle=False)
    net, opt, loader = rt.prepare(net, opt, loader)
    assert loader.batch_size == MICRO
    steps = 0
    for epoch in range(EPOCHS):
        rt.set_epoch(epoch)
        for x, y in loader:
            with rt.accumulate(net):
                with rt.autocast():
                    loss = torch.nn.functional.cross_entropy(net(x), y)
                rt.backward(loss)
            steps += rt.step(opt)
    assert steps == EPOCHS * N // (MICRO * rt.world_size * rt.accumulation_steps)
    net = getattr(net, "module", net)
    return [p.detach().flatten().tolist() for p in net.parameters()]


class HalfUsed(torch.nn.Module):  # type: ignore[misc]
    """A model with a parameter the forward never uses: DDP needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(DIM, CLASSES)
        self.unused = torch.nn.Linear(DIM, CLASSES)

    def forward(self, x: Any) -> Any:
        return self.used(x)


def train_counting_allreduces(rt: TorchRuntime) -> dict[str, int]:
    """Train HalfUsed for EPOCHS epochs; count the all-reduces DDP launches (one comm-hook call
    per bucket; bucket_cap_mb makes the one bucket) and the optimizer steps."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rt.init()
    loader = torch.utils.data.DataLoader(data(), batch_size=MICRO, shuffle=False)
    # Without find_unused_parameters reaching DDP, the second synced iteration raises.
    net, opt, loader = rt.prepare(HalfUsed(), None, loader, find_unused_parameters=True,
                                  bucket_cap_mb=64)
    assert net.find_unused_parameters
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    calls = [0]

    def counting_allreduce(state: object, bucket: Any) -> Any:
        calls[0] += 1
        return allreduce_hook(None, bucket)

    # DDP checks the hook's annotations against the real types; these are strings here.
    counting_allreduce.__annotations__ = {}
    net.register_comm_hook(None, counting_allreduce)
    steps = 0
    for epoch in range(EPOCHS):
        rt.set_epoch(epoch)
        for x, y in loader:
            with rt.accumulate(net):
                rt.backward(torch.nn.functional.cross_entropy(net(x), y))
            steps += rt.step(opt)
    return {"calls": calls[0], "steps": steps}


def _run_ranks(tmp_path: Path, world: int, timeout: float = 90) -> list[dict[str, Any]]:
    """Start `world` worker processes on a FileStore; kill all if any runs past `timeout`.
    Output goes to files: a full pipe would block a rank while the others wait on it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    init = f"file://{tmp_path / 'store'}"
    procs = []
    for r in range(world):
        with open(tmp_path / f"r{r}.log", "w") as log:
            cmd = [sys.executable, "-c", WORKER, str(tmp_path / f"r{r}.json"), str(r), str(world),
                   init, str(Path(__file__).parent)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=deadline(timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=deadline(10))
    for r, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"r{r}.log").read_text()
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


def _single(acc: int) -> list[Any]:
    rt = TorchRuntime("cpu", (), acc, None, MICRO, rank=0, local_rank=0, world_size=1, timeout_s=5)
    return [torch.tensor(w) for w in train(rt)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch of 2 gloo ranks, shared by the tests below (~5 s)."""
    return _run_ranks(tmp_path_factory.mktemp("ddp"), world=2)


@pytest.mark.slow
@pytest.mark.torch
def test_ddp_gloo_matches_one_process_accumulating(two_ranks: list[dict[str, Any]]) -> None:
    # Rank r of 2 gets indices r::2 (DistributedSampler, shuffle=False), so optimizer step k of
    # 2 ranks x A micro-steps covers samples [2Ak*MICRO, 2A(k+1)*MICRO), exactly what step k
    # of 1 process x 2A micro-steps covers; the mean gradient over a set is order-independent.
    initial = [p.detach().flatten() for p in model().parameters()]
    for acc in (1, 2):
        ddp = [[torch.tensor(w) for w in r["weights"][str(acc)]] for r in two_ranks]
        one = _single(2 * acc)
        for a, b, c, w0 in zip(ddp[0], ddp[1], one, initial, strict=True):
            assert torch.equal(a, b)  # DDP keeps the replicas identical
            assert torch.allclose(a, c, atol=1e-6), (acc, (a - c).abs().max())
            assert not torch.allclose(a, w0, atol=1e-3)  # training moved the weights


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("name", ["train", "val", "own"])
def test_set_epoch_reshuffles_every_prepared_loader(
    two_ranks: list[dict[str, Any]], name: str
) -> None:
    # "train" was prepared first, "val" by a second prepare(None, None, loader), "own" came with
    # its own DistributedSampler; set_epoch must reach all three samplers.
    base = {"train": 0, "val": 100, "own": 200}[name]
    shards = [r["shards"][name] for r in two_ranks]
    for epoch in (0, 1):
        a, b = shards[0][epoch], shards[1][epoch]
        assert sorted(a + b) == list(range(base, base + 16)) and not set(a) & set(b)
    assert shards[0][0] != shards[0][1] and shards[1][0] != shards[1][1]


@pytest.mark.slow
@pytest.mark.torch
def test_ddp_all_reduces_once_per_optimizer_step(two_ranks: list[dict[str, Any]]) -> None:
    # 2 ranks x 2 micro-steps of MICRO: N // (4 * MICRO) optimizer steps per epoch. Without
    # no_sync on the first micro-step DDP would all-reduce twice per optimizer step.
    for r in two_ranks:
        assert r["allreduces"] == {"calls": EPOCHS * N // (4 * MICRO),
                                   "steps": EPOCHS * N // (4 * MICRO)}


@pytest.mark.torch
def test_accumulation_steps_only_on_the_last_micro_step() -> None:
    rt = TorchRuntime("cpu", (), 3, 12, 4, rank=0, local_rank=0, world_size=1, timeout_s=5)
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    stepped = []
    for _ in range(6):
        rt.backward(net(torch.ones(4, 2)).sum())
        stepped.append(rt.step(opt))
    assert stepped == [False, False, True, False, False, True]
    assert net.weight.grad is None  # zeroed after each optimizer step


@pytest.mark.parametrize(
    ("cc", "expected"),
    [((9, 0), Precision("bfloat16")), ((8, 0), Precision("bfloat16")),
     ((12, 0), Precision("bfloat16")), ((7, 0), Precision("float16")),
     ((7, 5), Precision("float16")), ((6, 1), Precision("float32")), (None, Precision("float32"))],
)
def test_auto_precision(cc: tuple[int, int] | None, expected: Precision) -> None:
    assert precision_policy("auto", cc) == expected


def test_precision_needs_scaler_only_for_fp16() -> None:
    assert precision_policy("auto", (7, 0)).grad_scaler
    assert not precision_policy("auto", (8, 0)).grad_scaler
    assert precision_policy("fp32", (9, 0)) == Precision("float32")
    with pytest.raises(InvalidOptionError):
        precision_policy("int8", (9, 0))


@pytest.mark.parametrize(
    "kwargs",
    [dict(backend="single_device", devices=()), dict(backend="cpu", world_size=2),
     dict(backend="nccl", devices=(0,), world_size=2, local_rank=1), dict(backend="mpi")],
)
def test_invalid_runtimes_are_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = dict(
        backend="gloo", devices=(), accumulation_steps=1, global_batch_size=None,
        per_replica_batch_size=None, rank=0, local_rank=0, world_size=1, timeout_s=5.0,
    )
    with pytest.raises(InvalidOptionError):
        TorchRuntime(**{**args, **kwargs})  # type: ignore[arg-type]


@pytest.mark.torch
@pytest.mark.parametrize(("precision", "dtype", "scaled"), [("bf16", "bfloat16", False),
                                                           ("fp16", "float16", True)])
def test_explicit_precision_trains_on_cpu(precision: str, dtype: str, scaled: bool) -> None:
    rt = TorchRuntime("cpu", (), 2, 8, 4, rank=0, local_rank=0, world_size=1, timeout_s=5,
                      precision=precision)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = net.weight.detach().clone()
    for _ in range(2):
        with rt.autocast():
            out = net(torch.ones(4, 4))
        rt.backward(out.float().pow(2).mean())
        rt.step(opt)
    assert out.dtype == getattr(torch, dtype)
    assert (rt.scaler is not None) == scaled
    assert not torch.equal(net.weight, before)


class _RecordingModel:
    """Stands in for a DDP model: records whether no_sync() is entered."""

    def __init__(self) -> None:
        self.in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


class _CountingOptimizer:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _cpu(acc: int = 1, per_replica: int | None = None, **kw: Any) -> TorchRuntime:
    return TorchRuntime("cpu", (), acc, None, per_replica, rank=0, local_rank=0, world_size=1,
                        timeout_s=5, **kw)


def test_accumulate_enters_no_sync_on_all_but_the_last_micro_step() -> None:
    rt, model, opt = _cpu(acc=3), _RecordingModel(), _CountingOptimizer()
    seen, last = [], []
    for _ in range(6):
        last.append(rt.is_last_micro_step)
        with rt.accumulate(model):
            seen.append(model.in_no_sync)
        rt.step(opt)
    assert seen == [True, True, False, True, True, False]
    assert last == [False, False, True, False, False, True]
    assert opt.steps == 2 and not model.in_no_sync


@pytest.mark.torch
def test_fp16_step_reports_a_grad_scaler_skip() -> None:
    rt = _cpu(acc=2, precision="fp16")
    assert rt.scaler is not None
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def micro(x: Any) -> bool:
        with rt.accumulate(net):
            with rt.autocast():
                out = net(x)
            rt.backward(out.float().pow(2).mean())
        return bool(rt.step(opt))

    weights, scale = net.weight.detach().clone(), rt.scaler.get_scale()
    # 1e6 overflows float16 (max 65504): the autocast forward, loss and gradients go inf/nan.
    assert [micro(torch.full((4, 4), 1e6)), micro(torch.ones(4, 4))] == [False, False]
    assert torch.equal(net.weight, weights)  # the GradScaler skipped optimizer.step()
    assert rt.scaler.get_scale() == scale / 2  # ... and backed off its scale
    assert net.weight.grad is None  # the bad gradients were dropped, not carried on
    assert [micro(torch.ones(4, 4)), micro(torch.ones(4, 4))] == [False, True]
    assert not torch.equal(net.weight, weights)


@pytest.mark.torch
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_clip_grad_norm_clips_unscaled_gradients_on_the_last_micro_step(precision: str) -> None:
    rt = _cpu(acc=2, precision=precision)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten() for p in net.parameters()])
    norms = []
    for _ in range(2):
        with rt.accumulate(net):
            with rt.autocast():
                out = net(torch.ones(4, 4))
            rt.backward(out.float().mean())
        norms.append(rt.clip_grad_norm(net, 0.5, opt))
        assert rt.step(opt) == (norms[-1] is not None)
    after = torch.cat([p.detach().flatten() for p in net.parameters()])
    assert norms[0] is None
    # d mean(out) / d(weight, bias) is 0.5 everywhere (10 entries): norm sqrt(2.5). A norm taken
    # on fp16's scaled gradients would be 65536 times that, and clipping those (then unscaling)
    # would shrink the update by as much.
    assert float(norms[1]) == pytest.approx(2.5**0.5, rel=1e-3)
    assert torch.allclose((after - before).norm(), torch.tensor(0.5), rtol=1e-3)


@pytest.mark.torch
def test_prepare_keeps_a_matching_distributed_sampler_and_seeds_every_sampler() -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data_ = torch.arange(8)
    first = DataLoader(data_, batch_size=4, sampler=DistributedSampler(data_, 1, 0))
    second = DataLoader(data_, batch_size=4, sampler=DistributedSampler(data_, 1, 0))
    rt = _cpu(per_replica=2)
    model, opt, kept = rt.prepare(None, None, first)
    assert model is None and opt is None
    assert kept is not first and kept.batch_size == 2 and kept.sampler is first.sampler
    assert _cpu(per_replica=4).prepare(None, None, first)[2] is first  # same batch: as is
    rt.prepare(None, None, second)
    rt.set_epoch(3)
    assert first.sampler.epoch == 3 and second.sampler.epoch == 3


@pytest.mark.torch
def test_prepare_refuses_a_distributed_sampler_for_another_world() -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data_ = torch.arange(8)
    loader = DataLoader(data_, batch_size=4, sampler=DistributedSampler(data_, 2, 1))
    with pytest.raises(InvalidOptionError, match=r"num_replicas=2, rank=1.*world_size=1, rank=0"):
        _cpu().prepare(None, None, loader)


@pytest.mark.torch
def test_prepare_checks_ddp_kwargs_and_ignores_them_on_one_process() -> None:
    net = torch.nn.Linear(2, 1)
    rt = _cpu()
    assert rt.prepare(net, None, None, find_unused_parameters=True, static_graph=True)[0] is net
    with pytest.raises(InvalidOptionError, match="find_unused_params"):
        rt.prepare(net, find_unused_params=True)
    with pytest.raises(InvalidOptionError, match="device_ids"):
        rt.prepare(net, device_ids=[0])
