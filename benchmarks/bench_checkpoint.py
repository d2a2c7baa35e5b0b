"""What checkpoints cost the training step: none, synchronous and asynchronous (issue 33.4).

    python benchmarks/bench_checkpoint.py                          # CPU, one process
    python benchmarks/bench_checkpoint.py --device cuda            # one GPU
    torchrun --nproc_per_node 2 benchmarks/bench_checkpoint.py --device cuda --dir D [--sharding full]
    python benchmarks/bench_checkpoint.py --resume-check --device cuda --nproc 2 [--sharding full]

The table: an MLP (``--hidden`` x ``--depth``, AdamW: the checkpoint holds weights and two
moments) trained through the library's runtime (DDP, or FSDP2 with ``--sharding full``), with
no checkpoint, then with synchronous and with asynchronous checkpoints every 10 steps and
every ``--every`` steps. Every configuration is measured ``--rounds`` times, interleaved (none,
sync, async, ...), each on a fresh model whose first save (buffer allocation, the checkpoint's
own process group) happens before the timed window; the window is ``--steps`` steps, ending
half an interval after its last save so that the last background write overlaps steps too.
Columns: the mean step time; its overhead over no checkpoint (median of the rounds' ratios of
the timed windows); what one save cost the step (median of the checkpointer's own ``stall_s``:
the wait for the previous write, the host copy, and for sync the write itself); the write's own
time; and two projections for a checkpoint every ``--interval-s`` seconds (every few minutes):
what the step pays per save over that interval, and the window's extra time per save (its time
over no checkpoint divided by its saves: the background write's interference with the steps is
in it, and so is the machine's noise) over that interval. Rank 0 prints a markdown table.

``--resume-check``: an exact resume after a SIGKILL during an in-flight asynchronous write,
under ``resilient-strategy run`` on ``--nproc`` processes: the same short job run uninterrupted,
then with rank 0 killing itself (SIGKILL) right after a save whose write is still in flight; the
supervisor relaunches it from the previous complete checkpoint; the final weights of the two
runs are compared (max abs difference).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="per process")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per round")
    ap.add_argument("--every", type=int, default=30, help="the larger checkpoint interval")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval-s", type=float, default=180.0,
                    help="the projection: a checkpoint every this many seconds")
    ap.add_argument("--sharding", choices=("none", "full"), default="none")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--resume-check", action="store_true")
    ap.add_argument("--nproc", type=int, default=2, help="--resume-check: processes")
    ap.add_argument("--out", default=None, help="--resume-check: where the runs' files go")
    return ap.parse_args(argv)


# ----- the step-time table ---------------------------------------------------------------------
def _runtime(args: argparse.Namespace) -> Any:
    from resilient_strategy.frameworks.torch import TorchRuntime

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        backend = "nccl" if world > 1 else "single_device"
        devices: tuple[int, ...] = tuple(range(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    else:
        backend, devices = ("gloo" if world > 1 else "cpu"), ()
    return TorchRuntime(backend, devices, 1, args.batch * world, args.batch,
                        rank=int(os.environ.get("RANK", "0")), local_rank=local,
                        world_size=world, timeout_s=600, precision="fp32",
                        sharded=args.sharding == "full")


def _one(args: argparse.Namespace, mode: str, every: int, directory: Path) -> dict[str, Any]:
    """One round of one configuration: seconds of the timed window, its saves and their
    records."""
    import torch

    from resilient_strategy.frameworks.checkpoint import Checkpointer

    rt = _runtime(args)
    ckpt = None
    if mode != "none":
        ckpt = Checkpointer(directory, every_steps=every, rank=rt.rank, world_size=rt.world_size,
                            asynchronous=mode == "async", timeout_s=600,
                            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)))
        rt.use_checkpointer(ckpt)
    rt.init()
    torch.manual_seed(0)
    with rt.scope():
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, _ = rt.prepare(model, opt, None)
    x = torch.randn(args.batch, args.hidden, device=rt.device)
    y = torch.randint(0, 10, (args.batch,), device=rt.device)

    def step() -> None:
        rt.backward(torch.nn.functional.cross_entropy(model(x), y))
        rt.step(opt)

    def sync() -> None:
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)

    for _ in range(3):
        step()
    if ckpt is not None:  # the first save allocates (host buffers, DCP's group): not timed
        ckpt.save()
        ckpt.wait()
    while ckpt is not None and (ckpt.optimizer_steps + every // 2) % every:
        step()  # the window starts half an interval before a save
    sync()
    first = len(ckpt.saves) if ckpt is not None else 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - t0
    saves = list(ckpt.saves[first:]) if ckpt is not None else []
    if ckpt is not None:
        ckpt.wait()
        saves = list(ckpt.saves[first:first + len(saves)])
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return {"seconds": seconds, "saves": saves, "state_bytes": state_bytes}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def table(args: argparse.Namespace) -> str:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.dir:
        raise SystemExit("under torchrun, name the directory every rank writes in: --dir DIR")
    load = _load()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rs-bench-ckpt-"))
    configs = list(dict.fromkeys([("none", 0), ("sync", 10), ("async", 10),
                                  ("sync", args.every), ("async", args.every)]))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    try:
        for r in range(args.rounds):
            for mode, every in configs:
                directory = root / f"{mode}-{every}-{r}"
                runs[(mode, every)].append(_one(args, mode, every, directory))
                _barrier()  # every rank's writes are done before rank 0 removes them
                if rank == 0:
                    shutil.rmtree(directory, ignore_errors=True)
    finally:
        if rank == 0 and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    none = [r["seconds"] for r in runs[("none", 0)]]
    state_mb = runs[("none", 0)][0]["state_bytes"] / 2**20
    every_s = args.interval_s
    lines = [
        f"MLP {args.hidden}x{args.depth}, AdamW (weights and moments: {state_mb:.0f} MB), "
        f"batch {args.batch}, {args.sharding if args.sharding == 'full' else 'no'} sharding, "
        f"{world} process(es) on {where}; torch {torch.__version__}; {args.rounds} rounds of "
        f"{args.steps} steps; load average {load[0]:.1f} before, {_load()[0]:.1f} after",
        "",
        "| checkpoints | mean step | overhead (window) | the step pays per save | write per "
        f"save | one every {every_s:.0f} s: what the step pays | one every {every_s:.0f} s: "
        "window |",
        "|---|---|---|---|---|---|---|",
        f"| none | {1e3 * statistics.median(none) / args.steps:.2f} ms | - | - | - | - | - |",
    ]
    for mode, every in configs[1:]:
        rows = runs[(mode, every)]
        ratios = [r["seconds"] / n - 1 for r, n in zip(rows, none, strict=True)]
        saves = [s for r in rows for s in r["saves"]]
        stall = statistics.median(s.stall_s for s in saves) if saves else 0.0
        writes = [s.write_s for s in saves if s.write_s is not None]
        write = statistics.median(writes) if writes else 0.0
        per_save = statistics.median(
            (r["seconds"] - n) / max(1, len(r["saves"])) for r, n in zip(rows, none, strict=True))
        lines.append(
            f"| {mode}, every {every} steps | "
            f"{1e3 * statistics.median(r['seconds'] for r in rows) / args.steps:.2f} ms | "
            f"{100 * statistics.median(ratios):+.1f} % | {1e3 * stall:.1f} ms | "
            f"{1e3 * write:.1f} ms | {100 * stall / every_s:.3f} % | "
            f"{100 * per_save / every_s:+.3f} % |")
    return "\n".join(lines)


# ----- an exact resume after a SIGKILL during an in-flight write -------------------------------
_SCRIPT = '''
import json, os, signal, sys
from pathlib import Path
import resilient_strategy

out, steps, every, kill_at, hidden = Path(sys.argv[1]), *map(int, sys.argv[2:6])
sharding = sys.argv[6]
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=128,
                                            precision="fp32", sharding=sharding)
import torch
g = torch.Generator().manual_seed(0)
x = torch.randn(128 * steps, hidden, generator=g)
y = torch.randint(0, 10, (128 * steps,), generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                     batch_size=sel.batch_size, shuffle=True)
torch.manual_seed(0)
with sel.scope():
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = sel.checkpoint(out / "ckpt", every_steps=every)
model, opt, loader = sel.prepare(model, opt, loader)
sel.print(json.dumps({"resumed_at": ckpt.restored_step}))
marker = out / "killed.json"
for xb, yb in loader:
    xb, yb = xb.to(sel.device), yb.to(sel.device)
    sel.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    sel.step(opt)
    saves = ckpt.saves
    if kill_at and sel.launch.rank == 0 and sel.optimizer_steps >= kill_at \\
            and not marker.exists() and saves and saves[-1].step == sel.optimizer_steps:
        marker.write_text(json.dumps({"step": sel.optimizer_steps,
                                      "write": saves[-1].outcome}))
        os.kill(os.getpid(), signal.SIGKILL)  # the kernel's kill, the write in flight
weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
           for k, v in getattr(model, "module", model).state_dict().items()}
if sel.launch.rank == 0:
    torch.save(weights, out / "weights.pt")
sel.print(json.dumps({"steps": sel.optimizer_steps}))
sel.shutdown()
'''


def resume_check(args: argparse.Namespace) -> str:
    import torch

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rs-bench-resume-"))
    out.mkdir(parents=True, exist_ok=True)
    script = out / "job.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}
    env.setdefault("RESILIENT_STRATEGY_CACHE_DIR", str(out / "cache"))  # never over the user's
    if args.device == "cpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    steps, every, hidden = 60, 10, args.hidden
    rows = []
    for name, kill_at in (("uninterrupted", 0), ("sigkill", 25)):
        run = out / name
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        t0 = time.perf_counter()
        # written as they come: a run cut by a deadline still shows how far it got
        with open(run / "stdout.txt", "w") as so, open(run / "stderr.txt", "w") as se:
            code = subprocess.run(
                [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node",
                 str(args.nproc), "--sharding", args.sharding, "--evidence-dir", str(run / "ev"),
                 str(script), str(run), str(steps), str(every), str(kill_at), str(hidden),
                 args.sharding], env=env, stdout=so, stderr=se, timeout=600).returncode
        stdout = (run / "stdout.txt").read_text()
        killed = json.loads((run / "killed.json").read_text()) if (run / "killed.json").exists() \
            else None
        resumed = [json.loads(line)["resumed_at"] for line in stdout.splitlines()
                   if line.startswith('{"resumed_at"')]
        rows.append((name, code, killed, resumed, time.perf_counter() - t0))
    a, b = (out / "uninterrupted" / "weights.pt"), (out / "sigkill" / "weights.pt")
    diff = "missing weights"
    if a.exists() and b.exists():
        wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        diff = f"{max(float((wa[k] - wb[k]).abs().max()) for k in wa):.3g}"
    lines = [f"exact resume after a SIGKILL during an in-flight write: {args.nproc} processes, "
             f"{args.device}, sharding {args.sharding}, {steps} steps, checkpoint every {every}",
             "", "| run | exit | killed at (write then) | resumed at | wall |", "|---|---|---|---|---|"]
    for name, code, killed, resumed, wall in rows:
        at = "-" if killed is None else "step {step} ({write})".format(**killed)
        lines.append(f"| {name} | {code} | {at} | {', '.join(map(str, resumed))} | "
                     f"{wall:.1f} s |")
    lines += ["", f"max abs difference of the final weights: {diff}"]
    return "\n".join(lines)


def main() -> None:
    args = _args()
    if args.resume_check:
        print(resume_check(args), flush=True)
        return
    text = table(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
