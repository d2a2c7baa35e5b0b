"""FSDP2 through a Selection (issue 24): fully_shard on the units, the optimizer re-pointed, the
accumulation contract, the sharded probe's checks, and DCP checkpoints that resume on another
number of processes. Every test imports torch; those that start processes carry a deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from resilient_strategy.errors import InvalidOptionError  # noqa: E402
from resilient_strategy.frameworks import fsdp, sharded_checkpoint  # noqa: E402
from resilient_strategy.frameworks.torch import TorchRuntime  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch]
SRC = Path(__file__).parents[1] / "src"
ROOT = Path(__file__).parents[1]


class Block(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        return x + torch.tanh(self.lin(x))


def net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), Block(), Block(), torch.nn.Linear(8, 2))


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone (FSDP2 over a mesh of one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_shard_takes_the_named_units_and_repoints_the_optimizer(one_rank_group: None) -> None:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [id(p) for p in model.parameters()]
    model, opt = fsdp.shard(model, opt, device=torch.device("cpu"), world_size=1,
                            dtype="float32", classes=[Block])
    assert fsdp.is_sharded(model) and fsdp.is_sharded(model[1]) and fsdp.is_sharded(model[2])
    assert not fsdp.is_sharded(model[0])  # the root holds it
    now = list(model.parameters())
    assert [id(p) for p in now] != before
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in now]
    model(torch.ones(3, 4)).sum().backward()
    opt.step()  # the optimizer updates the parameters the model uses
    assert len(opt.state) == len(now)


def test_default_units_are_the_repeated_blocks() -> None:
    model = net()
    # two Linear layers (58 parameters) and two Blocks (144): the Blocks
    assert fsdp.units_of(model, None) == [model[1], model[2]]
    assert fsdp.units_of(model, [Block]) == [model[1], model[2]]
    with pytest.raises(InvalidOptionError):
        fsdp.units_of(model, [torch.nn.Conv2d])


def test_shard_refuses_what_it_chooses_and_an_optimizer_with_state(one_rank_group: None) -> None:
    with pytest.raises(InvalidOptionError):
        fsdp.check_kwargs({"mesh": None})
    with pytest.raises(InvalidOptionError):
        fsdp.check_kwargs({"find_unused_parameters": True})
    fsdp.check_kwargs({"reshard_after_forward": False})
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(InvalidOptionError):
        fsdp.shard(model, opt, device=torch.device("cpu"), world_size=1, dtype="float32")


def test_sharded_checkpoint_loads_into_a_plain_module(one_rank_group: None, tmp_path: Path) -> None:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fsdp.shard(model, opt, device=torch.device("cpu"), world_size=1,
                            dtype="float32")
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    step = sharded_checkpoint.save(tmp_path, model, opt, {"optimizer_steps": 7, "epoch": 1}, 0)
    assert sharded_checkpoint.latest(tmp_path) == step
    assert sharded_checkpoint.newest_is_sharded(tmp_path, tmp_path / "checkpoint.pt")
    plain = net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    meta = sharded_checkpoint.load(tmp_path, plain, plain_opt)
    assert meta is not None and (meta["optimizer_steps"], meta["epoch"]) == (7, 1)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b)
    assert len(plain_opt.state) == len(list(plain.parameters()))


def test_probe_checks_catch_a_wrong_all_gather_and_reduce_scatter(one_rank_group: None,
                                                                  tmp_path: Path) -> None:
    from resilient_strategy.probing.workers.common import ProbeFailure
    from resilient_strategy.probing.workers.torch_worker import _Collectives
    from resilient_strategy.records.progress import ProgressWriter

    ok = _Collectives(torch, dist, torch.device("cpu"), 0, 1, ProgressWriter(str(tmp_path / "p")),
                      "")
    ok.gathered(4096, 2)
    ok.scattered(4096, 2)
    bad = _Collectives(torch, dist, torch.device("cpu"), 0, 1,
                       ProgressWriter(str(tmp_path / "q")), "wrong")
    for check in (bad.gathered, bad.scattered):
        with pytest.raises(ProbeFailure) as err:
            check(4096, 1)
        assert err.value.cause == "wrong_result"


# ----- two processes ---------------------------------------------------------------------------
WORKER = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[5])
from test_fsdp import net, Block
from resilient_strategy.frameworks.torch import TorchRuntime
out, rank, world, init, _ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
acc = 2
rt = TorchRuntime("gloo", (), acc, None, 4, rank=rank, local_rank=rank, world_size=world,
                  timeout_s=60, init_method=init, sharded=True, precision="fp32",
                  offload=sys.argv[6:] == ["offload"])
model = net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
model, opt, loader = rt.prepare(model, opt, loader, shard_modules=[Block])
steps = 0
for xb, yb in loader:
    with rt.accumulate(model):
        rt.backward(torch.nn.functional.mse_loss(model(xb), yb))
    steps += rt.step(opt)
weights = [p.full_tensor().tolist() for p in model.parameters()]
policy = type(model._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
if rank == 0:
    json.dump({"weights": weights, "steps": steps, "policy": policy}, open(out, "w"))
rt.shutdown()
"""


def _two_ranks(tmp_path: Path, timeout: float = 120, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    init = f"file://{tmp_path / 'store'}"
    procs = []
    for r in range(2):
        with open(tmp_path / f"r{r}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", WORKER, str(tmp_path / "out.json"), str(r), "2", init,
                 str(Path(__file__).parent), *extra], env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=deadline(timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=deadline(10))
    for r, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"r{r}.log").read_text()[-3000:]
    result: dict[str, Any] = json.loads((tmp_path / "out.json").read_text())
    return result


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "cpu_offload"])
def test_fsdp_over_gloo_accumulating_matches_one_process(tmp_path: Path, offload: bool) -> None:
    # 2 ranks x 2 micro-steps of 4 cover what 1 process x 4 micro-steps of 4 covers (rank r
    # gets samples r::2); the mean gradient is the same, so are the weights after each step.
    # With CPU offload (CPUOffloadPolicy, unpinned on a CPU-only build) the same steps train.
    got = _two_ranks(tmp_path, 120, *(["offload"] if offload else []))
    assert got["policy"] == ("CPUOffloadPolicy" if offload else "OffloadPolicy")
    rt = TorchRuntime("cpu", (), 4, None, 4, rank=0, local_rank=0, world_size=1, timeout_s=5,
                      precision="fp32")
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g)
    order = [i for k in range(0, 64, 16) for r in (0, 1) for i in range(k + r, k + 16, 2)]
    steps = 0
    for k in range(0, 64, 4):
        idx = order[k:k + 4]
        rt.backward(torch.nn.functional.mse_loss(model(x[idx]), y[idx]))
        steps += rt.step(opt)
    assert got["steps"] == steps == 4
    for a, b in zip(got["weights"], model.parameters(), strict=True):
        assert torch.allclose(torch.tensor(a), b.detach(), atol=1e-6)


def _example(tmp_path: Path, nproc: int, *args: str) -> str:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--standalone", "examples/torch_fsdp_train.py",  # a port it binds itself
            "--samples", "2048", "--checkpoint-dir", str(tmp_path / "ckpt"), *args]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=deadline(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_example_shards_on_two_processes_and_resumes_on_one(tmp_path: Path) -> None:
    first = _example(tmp_path, 2, "--epochs", "1")
    assert "chose: FSDP over gloo on 2 CPU processes" in first
    assert "optimizer steps: 8" in first  # 2048 samples / 256 per optimizer step
    assert sharded_checkpoint.latest(tmp_path / "ckpt") is not None
    # issue 36: on two processes again, each rank reads the metadata through the checked reader
    second = _example(tmp_path, 2, "--epochs", "2")
    assert "resumed at optimizer step 8" in second
    assert "optimizer steps: 16" in second
    third = _example(tmp_path, 1, "--epochs", "3")
    assert "resumed at optimizer step 16" in third
    assert "optimizer steps: 24" in third
    ckpt = tmp_path / "ckpt"
    assert {p.stat().st_mode & 0o777 for p in ckpt.rglob("*") if p.is_file()} == {0o600}
    assert {p.stat().st_mode & 0o777 for p in [ckpt, *ckpt.rglob("*")] if p.is_dir()} == {0o700}


def test_run_arguments_plan_memory_like_the_script() -> None:
    from resilient_strategy.run.cmdline import options_from_args
    from resilient_strategy.run.supervisor import _options
    from resilient_strategy.testing import machine

    script = str(ROOT / "examples" / "torch_fsdp_train.py")
    opts = options_from_args(["--nproc-per-node", "2", "--sharding", "full", "--param-bytes",
                              "4096", "--optimizer-state-factor", "1", script])
    assert (opts.sharding, opts.param_bytes, opts.optimizer_state_factor) == ("full", 4096, 1.0)
    planned, _ = _options(opts, machine(0, torch="2.13.0"), {})
    assert (planned.sharding, planned.param_bytes, planned.optimizer_state_factor) == (
        "full", 4096, 1.0)
    with pytest.raises(InvalidOptionError, match="half"):  # a mode it does not know: one line
        options_from_args(["--sharding", "half", script])


def test_an_offloading_decision_chooses_the_offload_policy_itself() -> None:
    fsdp.check_kwargs({"offload_policy": None})  # the user's own, when the decision keeps it
    with pytest.raises(InvalidOptionError):
        fsdp.check_kwargs({"offload_policy": None}, offload=True)


ONE_RANK_OFFLOAD = r"""
import json, sys
import torch
from resilient_strategy.frameworks.torch import TorchRuntime
rt = TorchRuntime("cpu", (), 2, None, 4, rank=0, local_rank=0, world_size=1, timeout_s=30,
                  precision="fp32", sharded=True, offload=True)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
m, opt, _ = rt.prepare(m, opt)
x, y = torch.randn(16, 4), torch.randn(16, 2)
losses, steps = [], 0
for _ in range(8):
    with rt.accumulate(m):
        loss = torch.nn.functional.mse_loss(m(x), y)
        rt.backward(loss)
    losses.append(loss.item())
    steps += rt.step(opt)
policy = type(m[0]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
print(json.dumps({"steps": steps, "policy": policy, "first": losses[0], "last": losses[-1]}))
rt.shutdown()
"""


def test_one_process_fsdp_with_cpu_offload_joins_a_group_of_one_and_trains() -> None:
    # the single-rank path of a one-GPU offload decision, here on the CPU (a fresh interpreter:
    # the runtime starts its own group of one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ONE_RANK_OFFLOAD], env=env, capture_output=True,
                         text=True, timeout=deadline(120))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["steps"] == 4 and got["policy"] == "CPUOffloadPolicy"
    assert got["last"] < got["first"]
