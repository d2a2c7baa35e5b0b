"""TorchRuntime: DDP over gloo (2 CPU processes) trains exactly like 1 process accumulating."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import resilient_strategy.frameworks.torch as runtime_module
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.torch import Precision, TorchRuntime, precision_policy

torch = pytest.importorskip("torch")

SRC = Path(runtime_module.__file__).parents[2]  # the package the tests import
N, DIM, CLASSES, MICRO = 64, 8, 4, 4  # samples, features, classes, per-replica micro-batch
EPOCHS, LR = 2, 0.5

# Runs one configuration in a fresh process: `python -c WORKER out rank world init_file`.
# Phase 1/2: train with 1 and 2 accumulation steps; phase 3: record a shuffled loader's shards.
WORKER = """
import json, sys
sys.path.insert(0, sys.argv[5])
import torch
from resilient_strategy.frameworks.torch import TorchRuntime
from test_frameworks_torch import MICRO, train

out, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
result = {"weights": {}, "shards": []}
for acc in (1, 2):
    rt = TorchRuntime("gloo", (), acc, None, MICRO, rank=rank, local_rank=rank,
                      world_size=world, timeout_s=30, init_method=init)
    result["weights"][acc] = train(rt)
loader = torch.utils.data.DataLoader(torch.arange(16), batch_size=16, shuffle=True)
_, _, loader = rt.prepare(torch.nn.Linear(1, 1), None, loader)
for epoch in range(2):
    rt.set_epoch(epoch)
    result["shards"].append([int(i) for batch in loader for i in batch])
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
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
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
def test_set_epoch_reshuffles_disjoint_shards(two_ranks: list[dict[str, Any]]) -> None:
    shards = [r["shards"] for r in two_ranks]
    for epoch in (0, 1):
        a, b = shards[0][epoch], shards[1][epoch]
        assert sorted(a + b) == list(range(16)) and not set(a) & set(b)
    assert shards[0][0] != shards[0][1]


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
