"""The multi-GPU evidence of issue 14, every row in one run (run through gpu_session.sh).

    python benchmarks/bench_gpu_evidence.py                 # on a 2-GPU machine: the real run
    python benchmarks/bench_gpu_evidence.py --cpu-check     # the same steps on CPU (plumbing)
    python benchmarks/bench_gpu_evidence.py --only decision,fidelity   # some groups only

Groups (``--only``), each a set of table rows:
  decision   healthy cold and cached decision; plain NCCL hanging in its first collective
             (``RESILIENT_STRATEGY_PROBE_FAULT=<hang>:1:nccl:plain``) and every NCCL variant
             hanging, at default settings: time to a working strategy; a healthy cold probe with
             and without the fork-server (``RESILIENT_STRATEGY_FORKSERVER=0``).
  fidelity   the probe at each message size 256 KiB..64 MiB (exactly checked where the probe
             checks that size); a wrong value injected only at a large size
             (``wrong:1:nccl:>=N``) must be caught.
  shm        after a killed hung NCCL probe: the GPU health check's verdict and time,
             ``/dev/shm/nccl-*`` segments and probe processes left (goal 0).
  train      ``resilient-strategy run --nproc-per-node 2 examples/torch_train.py`` (100M-param
             MLP, global batch 512, checkpoints on) healthy against hand-written DDP; with
             ``RESILIENT_STRATEGY_TRAIN_FAULT=hang:1:nccl:200`` and ``exit:1:nccl:200``: time
             from the fault to training again, what it relaunched on, samples/s after, optimizer
             steps equal to healthy; chosen against best for each fault (every strategy that
             works without NCCL measured here through RESILIENT_STRATEGY_PREFER).
  brokenenv  the earlier session's rows (README): ``torchrun examples/torch_train.py`` with NCCL
             broken by the environment (NCCL_ALGO=bogus; P2P and SHM off with no socket
             interface): the decision, its time, samples/s.
  multinode  two nodes simulated on this host, one GPU each (``--nnodes 2`` over c10d on
             127.0.0.1): healthy and with a cross-node probe fault.
  single     the whole test suite (RS_GPU_TESTS=1), the GPU health check, the per-step cost of
             progress reporting.
  train1     one GPU: ``resilient-strategy run --nproc-per-node 1 examples/torch_train.py``
             against the hand-written loop under torchrun on the same GPU.

On a machine with one GPU (the lent single-GPU kinds) only ``single``, ``shm``, ``fidelity``
(one rank: NCCL's setup and the exact checks, no link) and ``train1`` run; the results go to
``benchmarks/results/<gpu>x1-<date>.md``.

With ``--cpu-check`` NCCL is stood in for by gloo between CPU processes, the sizes are tiny and
the probe timeout is ``--timeout`` (10 s): it checks that every step runs and every row is
filled; a row that needs a GPU says "needs GPU". Its raw output goes to a temporary file, never
to ``benchmarks/results/``. The real run writes ``benchmarks/results/h200x2-<date>.md``.
The environment passes to every process as it is (NCCL_NVLS_ENABLE and the other variables the
machine sets stay untouched); only RESILIENT_STRATEGY_* variables of each measurement are added.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
sys.path.insert(0, SRC)

import resilient_strategy  # noqa: E402
from resilient_strategy.core.measures.probe import ProbeSpec  # noqa: E402
from resilient_strategy.probing.prober import run_probe  # noqa: E402
from resilient_strategy.probing.workers import common as _common  # noqa: E402

GROUPS = ("decision", "fidelity", "shm", "train", "brokenenv", "multinode", "single", "train1")
#: What a machine with one GPU can measure (the lent single-GPU kinds).
ONE_GPU_GROUPS = ("single", "shm", "fidelity", "train1")
NEEDS_GPU = "needs GPU"
FAULT = "RESILIENT_STRATEGY_PROBE_FAULT"
MIB = 1 << 20
SIZES_GPU = (256 << 10, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
SIZES_CPU = (256 << 10, 1 * MIB, 4 * MIB)
#: The hand-written DDP loop the library's run is compared with: the same model, data, batch,
#: optimizer and checkpoint cadence as examples/torch_train.py, written as torch's tutorial does.
HAND_DDP = '''
import argparse, os, time
import torch, torch.distributed as dist, torch.nn.functional as F
p = argparse.ArgumentParser()
for a, d in (("--global-batch-size", 256), ("--epochs", 3), ("--samples", 20000),
             ("--hidden", 256), ("--depth", 2), ("--checkpoint-every", 50)):
    p.add_argument(a, type=int, default=d)
p.add_argument("--checkpoint-dir", default=None)
args = p.parse_args()
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)
g = torch.Generator().manual_seed(0)
x = torch.randn(args.samples, 32, generator=g)
y = (x @ torch.randn(32, 10, generator=g) + 0.5 * torch.randn(args.samples, 10, generator=g)
     ).argmax(dim=1)
data = torch.utils.data.TensorDataset(x, y)
sampler = torch.utils.data.DistributedSampler(data, shuffle=True)
loader = torch.utils.data.DataLoader(data, batch_size=args.global_batch_size // world,
                                     sampler=sampler, drop_last=True)
torch.manual_seed(0)
layers = [torch.nn.Linear(32, args.hidden), torch.nn.GELU()]
for _ in range(args.depth - 1):
    layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10)).to(dev)
model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if cuda else None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
steps = 0
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    start, n = time.perf_counter(), 0
    for xb, yb in loader:
        xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        steps, n = steps + 1, n + 1
        if args.checkpoint_dir and steps % args.checkpoint_every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.checkpoint_dir, "ckpt.pt"))
    if rank == 0:
        rate = n * args.global_batch_size / (time.perf_counter() - start)
        print(f"epoch {epoch + 1}: {n} optimizer steps, {rate:,.0f} samples/s", flush=True)
if rank == 0:
    print(f"optimizer steps: {steps}", flush=True)
dist.destroy_process_group()
'''
#: What each simulated node runs: decide, write the decision.
NODE_JOB = '''
import json, os, sys
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64,
                                            gradient_bytes=40_000, sample_seconds=0.001)
with open(os.path.join(sys.argv[1], f"decision-{os.environ['RANK']}.json"), "w") as f:
    json.dump(sel.to_dict(), f)
'''


@dataclass
class Row:
    group: str
    what: str
    value: str
    goal: str = ""
    detail: str = ""


@dataclass
class Ctx:
    gpu: bool
    backend: str  # "nccl" on GPUs, "gloo" in the CPU check
    devices: tuple[int, ...]
    timeout: float | None  # probe timeout; None: the library's default
    raw: TextIO
    tmp: Path
    rows: list[Row] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)  # samples/s of each training run

    def add(self, group: str, what: str, value: str, goal: str = "", detail: str = "") -> None:
        self.rows.append(Row(group, what, value, goal, detail))
        self.log(f"ROW | {group} | {what} | {value} | {goal} | {detail}")

    def log(self, text: str) -> None:
        self.raw.write(text.rstrip("\n") + "\n")
        self.raw.flush()

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment, without a stray RESILIENT_STRATEGY_* variable, plus
        ``extra``. Everything else (NCCL_NVLS_ENABLE, ...) passes untouched."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
        if self.timeout is not None:
            env["RESILIENT_STRATEGY_TIMEOUT"] = f"{self.timeout:g}"
        env.update(extra)
        return env

    def cache(self) -> str:
        return tempfile.mkdtemp(prefix="cache-", dir=self.tmp)


# -- helpers ------------------------------------------------------------------------------------

def hang_kind() -> str:
    """The fault that hangs inside the first collective where the probe has one (issue 10's
    ``hang_collective``), else ``hang`` (before it, the communicator ready)."""
    return "hang_collective" if "hang_collective" in _common.FAULTS else "hang"


def run_logged(ctx: Ctx, argv: Sequence[str], env: Mapping[str, str], timeout_s: float,
               cwd: str | None = None) -> tuple[int | None, list[tuple[float, str]]]:
    """Run ``argv`` in its own process group; every output line, stamped (monotonic seconds),
    goes to the raw log. The whole group is killed at the deadline (exit code None)."""
    ctx.log(f"$ {' '.join(argv)}")
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(argv, env=dict(env), cwd=cwd or str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    out = proc.stdout

    def read() -> None:  # stamps each line as it arrives
        for line in out:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # the job's whole group: torchrun's workers, and what a killed job left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    for _, line in lines:
        ctx.log(f"  {line}")
    if timed_out:
        ctx.log(f"  (killed at the deadline, {timeout_s:g} s)")
    return (None if timed_out else proc.returncode), lines


def decide(ctx: Ctx, env: Mapping[str, str], cache_dir: str,
           probe: str = "force") -> tuple[Any, float]:
    kw: dict[str, Any] = {"framework": "torch", "global_batch_size": 64 * 2,
                          "cache_dir": cache_dir, "probe": probe, "env": dict(env)}
    t = time.perf_counter()
    sel = resilient_strategy.resilient_strategy(**kw)
    dt = time.perf_counter() - t
    ctx.log(f"decision in {dt:.2f} s: {sel.candidate.label}; probes: "
            + ", ".join(f"{k} {r.status} {r.cause} {r.elapsed_s:.1f}s"
                        for k, r in sel.results.items()))
    return sel, dt


def launch_env(ctx: Ctx, **extra: str) -> dict[str, str]:
    """As local rank 0 of a simulated 2-process torchrun launch (bench_decision does the same)."""
    return ctx.env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_PORT="0", **extra)


def probe_spec(ctx: Ctx, message_bytes: int, timeout_s: float = 60.0) -> ProbeSpec:
    world = len(ctx.devices) if ctx.gpu else 2
    key = f"torch:{ctx.backend}:" + (f"gpu{','.join(map(str, ctx.devices))}" if ctx.gpu else "cpu")
    return ProbeSpec(key, "torch", ctx.backend, ctx.devices, world_size=world, timeout_s=timeout_s,
                     message_bytes=message_bytes, train_step=False)


def last_rank(ctx: Ctx) -> int:
    """The rank a fault is injected on: rank 1 of 2 (rank 0 alone on a 1-GPU machine)."""
    return max(0, len(ctx.devices) - 1) if ctx.gpu else 1


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("nccl-")}
    except OSError:
        return set()


def probe_processes() -> list[str]:
    """This process's probe and health workers still running (each gets ``--parent-pid``)."""
    out, mine = [], f"--parent-pid {os.getpid()} "
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resilient_strategy.probing.workers." in cmd and mine in cmd + " ":
            out.append(f"{pid} {cmd[:120]}")
    return out


def goal(ok: bool) -> str:
    return "met" if ok else "NOT met"


# -- groups -------------------------------------------------------------------------------------

def group_decision(ctx: Ctx) -> None:
    g, b = "decision", ctx.backend
    what = f"{b} on 2 GPUs" if ctx.gpu else "gloo on 2 CPU processes"
    sel, cold = decide(ctx, launch_env(ctx), ctx.cache())
    ctx.add(g, f"healthy cold decision ({what})", f"{cold:.2f} s",
            f"<= 5 s: {goal(cold <= 5)}" if ctx.gpu else "<= 5 s on GPUs",
            sel.candidate.label)
    cache = ctx.cache()
    decide(ctx, launch_env(ctx), cache)
    warm = [decide(ctx, launch_env(ctx), cache, probe="auto")[1] for _ in range(3)]
    ctx.add(g, "cached decision (median of 3)", f"{statistics.median(warm) * 1e3:.1f} ms")
    kind = hang_kind()
    for label, fault, limit in (
            (f"plain {b} hangs in its first collective", f"{kind}:1:{b}:plain", 15.0),
            (f"every {b} variant hangs", f"{kind}:1:{b}", 25.0)):
        sel, dt = decide(ctx, launch_env(ctx, **{FAULT: fault}), ctx.cache())
        hung = [k for k, r in sel.results.items() if r.status == "timeout"]
        ctx.add(g, f"{label}: time to a working strategy", f"{dt:.2f} s",
                f"<= {limit:g} s: {goal(dt <= limit)}" if ctx.gpu else f"<= {limit:g} s on GPUs",
                f"{sel.candidate.label}; {FAULT}={fault}; cut: {', '.join(hung) or 'none'}")
    forkserver = importlib.util.find_spec("resilient_strategy.probing.forkserver") is not None
    for label, extra in (("healthy cold probe, fork-server (default)", {}),
                         ("healthy cold probe, RESILIENT_STRATEGY_FORKSERVER=0",
                          {"RESILIENT_STRATEGY_FORKSERVER": "0"})):
        sel, dt = decide(ctx, launch_env(ctx, **extra), ctx.cache())
        probes = ", ".join(f"{r.elapsed_s:.2f} s" for r in sel.results.values())
        ctx.add(g, label, f"{dt:.2f} s", "",
                f"probe(s) {probes}" + ("" if forkserver else
                                        "; no fork-server on this branch (issue 10): same path"))


def group_fidelity(ctx: Ctx) -> None:
    g = "fidelity"
    sizes = SIZES_GPU if ctx.gpu else SIZES_CPU
    checks_message = hasattr(_common, "check_sizes")  # issue 10: the timed size is checked too
    env = ctx.env()
    for nbytes in sizes:
        res = run_probe(probe_spec(ctx, nbytes), env)
        ctx.log(f"probe at {nbytes} B: {res}")
        bw = f", {res.bus_bandwidth_gbps:.2f} GB/s bus" if res.bus_bandwidth_gbps else ""
        ctx.add(g, f"{ctx.backend} all-reduce at {_common_human(nbytes)}",
                f"{res.status}{bw}", "exact" if checks_message else "",
                ("checked exactly" if checks_message else
                 "timed only: this branch's probe checks 4 KiB exactly (issue 10 adds the sizes)")
                + f"; {res.elapsed_s:.1f} s")
    big = sizes[-1]
    floor = big // 2
    fault = f"wrong:{last_rank(ctx)}:{ctx.backend}:>={floor}"
    res = run_probe(probe_spec(ctx, big), ctx.env(**{FAULT: fault}))
    ctx.log(f"wrong value at >= {floor} B: {res}")
    caught = res.cause == "wrong_result"
    ctx.add(g, f"wrong value injected only at >= {_common_human(floor)} "
               f"(probe at {_common_human(big)})",
            "caught" if caught else f"NOT caught ({res.status})", "caught: " + goal(caught),
            f"{FAULT}={fault}; {res.status} {res.cause}")


def _common_human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def group_shm(ctx: Ctx) -> None:
    g = "shm"
    before, procs_before = shm_segments(), set(probe_processes())
    fault = f"{hang_kind()}:{last_rank(ctx)}:{ctx.backend}"
    res = run_probe(probe_spec(ctx, 16 * MIB if ctx.gpu else MIB, timeout_s=15.0),
                    ctx.env(**{FAULT: fault}))
    ctx.log(f"hung probe: {res}")
    ctx.add(g, f"hung {ctx.backend} probe ({len(ctx.devices) or 2} rank(s)) killed at its "
            "deadline", f"{res.status}",
            "timeout", f"{FAULT}={fault}; {res.elapsed_s:.1f} s")
    health_check(ctx, g, ctx.devices, "GPU health check after the killed probe")
    left = sorted(shm_segments() - before)
    procs = sorted(set(probe_processes()) - procs_before)
    ctx.add(g, "/dev/shm nccl-* segments left", str(len(left)), "0: " + goal(not left),
            ", ".join(left)[:200])
    ctx.add(g, "probe processes left", str(len(procs)), "0: " + goal(not procs),
            "; ".join(procs)[:200])


def health_check(ctx: Ctx, g: str, devices: tuple[int, ...], label: str) -> None:
    if not ctx.gpu:
        ctx.add(g, label, NEEDS_GPU)
        return
    if importlib.util.find_spec("resilient_strategy.probing.health") is None:
        ctx.add(g, label, "not run", "", "no GPU health check on this branch (issue 10)")
        return
    from resilient_strategy.probing import health  # type: ignore[attr-defined,unused-ignore]

    t = time.perf_counter()
    broken = health.run_check("torch", devices, ctx.env())
    dt = time.perf_counter() - t
    ctx.add(g, label, "healthy" if not broken else f"BROKEN: {broken}", "",
            f"GPUs {','.join(map(str, devices))} in {dt:.2f} s")


RATE = re.compile(r"([0-9][0-9,]*) samples/s")


#: The supervisor's relaunch line: ``relaunch N[ of M]: retrying|stepping down on <label> (...)``.
RELAUNCH = re.compile(r"relaunch \d+(?: of \d+)?: (retrying|stepping down) on (.+?) \(")


@dataclass
class TrainRun:
    rc: int | None
    lines: list[tuple[float, str]]

    def last_rate(self) -> float | None:
        rates = [float(m.group(1).replace(",", "")) for _, s in self.lines
                 if "epoch" in s and (m := RATE.search(s))]
        return rates[-1] if rates else None

    def find(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        rx = re.compile(pattern)
        return next(((t, s) for t, s in self.lines if t >= after and rx.search(s)), None)

    def steps(self) -> str:
        hit = [s for _, s in self.lines if s.startswith("optimizer steps:")]
        return hit[-1].split(":", 1)[1].strip() if hit else "?"

    def chose(self) -> str:
        hit = [s.split("chose:", 1)[1].strip() for _, s in self.lines if "chose:" in s]
        return hit[-1].split(" (")[0].rstrip(".") if hit else "?"


def group_train(ctx: Ctx, args: argparse.Namespace) -> None:
    g, b = "train", ctx.backend
    if ctx.gpu:
        model = ["--hidden", "4096", "--depth", "7", "--global-batch-size", "512",
                 "--samples", "262144", "--epochs", "2", "--checkpoint-every", "50"]
        step, run_extra, limit = 200, [], 600.0
    else:
        model = ["--hidden", "64", "--depth", "2", "--global-batch-size", "64",
                 "--samples", "4096", "--epochs", "2", "--checkpoint-every", "5"]
        step, run_extra, limit = 20, ["--stall-timeout", "5"], 300.0
    params = 32 * int(model[1]) + (int(model[3]) - 1) * int(model[1]) ** 2 + int(model[1]) * 10

    def supervised(label: str, samples: str = "", **extra: str) -> TrainRun:
        ckpt = tempfile.mkdtemp(prefix="ckpt-", dir=ctx.tmp)
        env = ctx.env(RESILIENT_STRATEGY_CACHE_DIR=ctx.cache(), **extra)
        ctx.log(f"== train: {label}")
        rc, lines = run_logged(ctx, [sys.executable, "-m", "resilient_strategy", "run",
                                     "--nproc-per-node", "2", *run_extra,
                                     "examples/torch_train.py", *model,
                                     *(["--samples", samples] if samples else []),
                                     "--checkpoint-dir", ckpt],
                               env, limit)
        return TrainRun(rc, lines)

    healthy = supervised("healthy")
    rate = healthy.last_rate()
    ctx.log("== train: hand-written DDP")
    hand_py = ctx.tmp / "hand_ddp.py"
    hand_py.write_text(HAND_DDP)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    rc, lines = run_logged(ctx, [*torchrun, str(hand_py), *model, "--checkpoint-dir",
                                 tempfile.mkdtemp(prefix="ckpt-", dir=ctx.tmp)], ctx.env(), limit)
    hand = TrainRun(rc, lines).last_rate()
    ratio = rate / hand if rate and hand else None
    ctx.add(g, f"healthy run ({params:,} params, batch {model[5]}): samples/s (last epoch)",
            f"{rate:,.0f}" if rate else f"failed (exit {healthy.rc})",
            "", f"{healthy.chose()}; optimizer steps {healthy.steps()}")
    ctx.add(g, "hand-written DDP: samples/s (last epoch)", f"{hand:,.0f}" if hand else
            f"failed (exit {rc})", "", f"{b}, same model, batch; torch.save on rank 0 as often")
    ctx.add(g, "healthy against hand-written DDP", f"{ratio:.3f}" if ratio else "?",
            ">= 0.99: " + goal(bool(ratio and ratio >= 0.99)) if ctx.gpu else ">= 0.99 on GPUs")

    # Every strategy that works when NCCL does not: NCCL's probe fails, then each is preferred.
    kind = hang_kind()
    if args.no_alternatives:
        for kind_ in ("hang", "exit"):
            fault = f"{kind_}:1:{b}:{step}"
            run = supervised(f"train fault {fault}", RESILIENT_STRATEGY_TRAIN_FAULT=fault)
            _fault_rows(ctx, g, fault, run, healthy)
        return
    no_b = {FAULT: f"{kind}:1:{b}"}
    alternatives: dict[str, float] = {}
    default_under_fault = supervised(f"{b} probe hangs, default choice", **no_b)
    # on GPUs: gloo (~30x slower than NCCL here: a shorter epoch) and one GPU; CPU is no rival
    for prefer in ("gloo", "single_device") if ctx.gpu else ("single_device", "cpu"):
        r = supervised(f"{b} probe hangs, RESILIENT_STRATEGY_PREFER={prefer}",
                       "65536" if ctx.gpu and prefer == "gloo" else "", **no_b,
                       RESILIENT_STRATEGY_PREFER=prefer)
        if (x := r.last_rate()) is not None:
            alternatives[r.chose()] = max(x, alternatives.get(r.chose(), 0.0))
    chosen_rate = default_under_fault.last_rate()
    if chosen_rate is not None:
        alternatives[default_under_fault.chose()] = max(
            chosen_rate, alternatives.get(default_under_fault.chose(), 0.0))
    best_label, best = max(alternatives.items(), key=lambda kv: kv[1], default=("?", 0.0))
    ctx.add(g, f"strategies that work with {b} broken (samples/s)",
            ", ".join(f"{k}: {v:,.0f}" for k, v in alternatives.items()) or "none measured")

    def chosen_vs_best(label: str, got: float | None, what: str) -> None:
        top, top_label = (got, what) if got and got > best else (best, best_label)
        r = got / top if got and top else None  # the chosen run itself may be the fastest
        ctx.add(g, f"chosen against best: {label}", f"{r:.3f}" if r else "?",
                (">= 0.95: " + goal(bool(r and r >= 0.95))) if ctx.gpu else ">= 0.95 on GPUs",
                f"chosen {what} {got or 0:,.0f}; best {top_label} {top:,.0f}")

    chosen_vs_best(f"{b} probe hangs", chosen_rate, default_under_fault.chose())
    for kind_ in ("hang", "exit"):
        fault = f"{kind_}:1:{b}:{step}"
        run = supervised(f"train fault {fault}", RESILIENT_STRATEGY_TRAIN_FAULT=fault)
        after, on = _fault_rows(ctx, g, fault, run, healthy)
        chosen_vs_best(f"TRAIN_FAULT={fault}", after, on)


def _fault_rows(ctx: Ctx, g: str, fault: str, run: TrainRun,
                healthy: TrainRun) -> tuple[float | None, str]:
    """The rows of one mid-run fault: time from the fault to training again, what it relaunched
    on (retrying or stepping down), samples/s after, optimizer steps against the healthy run."""
    hit = run.find(r"RESILIENT_STRATEGY_TRAIN_FAULT: rank")
    relaunch = run.find(RELAUNCH.pattern, hit[0] if hit else 0.0)
    again = run.find(r"resumed from|replica\(s\) x", relaunch[0] if relaunch else 1e18)
    where = RELAUNCH.search(relaunch[1]) if relaunch else None
    on = f"{where.group(2)} ({where.group(1)})" if where else "?"
    after = run.last_rate()
    same = run.steps() == healthy.steps() and run.steps() != "?"
    ctx.add(g, f"TRAIN_FAULT={fault}: fault to training again",
            f"{again[0] - hit[0]:.1f} s" if hit and again else f"? (exit {run.rc})", "",
            f"relaunched on {on}" + (f"; {relaunch[1].split(':', 2)[-1][:90]}"
                                     if relaunch else ""))
    ctx.add(g, f"TRAIN_FAULT={fault}: samples/s after; optimizer steps",
            f"{after:,.0f}; {run.steps()}" if after else f"?; {run.steps()}",
            f"steps = healthy ({healthy.steps()}): {goal(same)}")
    return after, on


def group_brokenenv(ctx: Ctx) -> None:
    g = "brokenenv"
    if ctx.gpu:
        model = ["--hidden", "4096", "--depth", "7", "--global-batch-size", "512",
                 "--samples", "262144", "--epochs", "2"]
    else:
        model = ["--hidden", "64", "--depth", "2", "--global-batch-size", "64",
                 "--samples", "4096", "--epochs", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d"]
    for label, extra in (
            ("NCCL_ALGO=bogus", {"NCCL_ALGO": "bogus"}),
            ("P2P+SHM off, NCCL_SOCKET_IFNAME=nonexistent0",
             {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
              "NCCL_SOCKET_IFNAME": "nonexistent0"})):
        env = ctx.env(RESILIENT_STRATEGY_CACHE_DIR=ctx.cache(), **extra)
        ctx.log(f"== brokenenv: {label}")
        rc, lines = run_logged(ctx, [*torchrun, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                                     "examples/torch_train.py", *model], env, 600)
        run = TrainRun(rc, lines)
        decided = run.find(r"decided in ([0-9.]+) s")
        took = re.search(r"decided in ([0-9.]+) s", decided[1]).group(1) if decided else "?"  # type: ignore[union-attr]
        rate = run.last_rate()
        ctx.add(g, f"torchrun example, {label}", f"{rate:,.0f} samples/s" if rate else
                f"failed (exit {rc})", "", f"{run.chose()}; decided in {took} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_multinode(ctx: Ctx) -> None:
    g, b = "multinode", ctx.backend
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    for label, fault in (("healthy", ""), (f"{b} hangs on node 1 (rank 1)", f"hang:1:{b}")):
        work = Path(tempfile.mkdtemp(prefix="mn-", dir=ctx.tmp))
        (work / "job.py").write_text(NODE_JOB)
        port, rid = free_port(), uuid.uuid4().hex[:8]
        extra = {"RESILIENT_STRATEGY_CACHE": "0"}
        if fault:
            extra[FAULT] = fault
        argv = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rid, str(work / "job.py"),
                str(work)]
        ctx.log(f"== multinode {label}: {' '.join(argv)}")
        t0 = time.perf_counter()
        procs = []
        for node in range(2):  # one GPU per simulated node
            env = ctx.env(**extra)
            if ctx.gpu:
                env["CUDA_VISIBLE_DEVICES"] = str(ctx.devices[node])
            procs.append(subprocess.Popen(argv, env=env, cwd=str(work), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=300)[0])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                outs.append(p.communicate()[0] + "\n(killed at 300 s)")
        wall = time.perf_counter() - t0
        for node, out in enumerate(outs):
            ctx.log(f"-- node {node} (exit {procs[node].returncode})\n{out}")
        decisions = [json.loads(f.read_text()) for f in sorted(work.glob("decision-*.json"))]
        if len(decisions) != 2:
            ctx.add(g, f"2 nodes x 1 {'GPU' if ctx.gpu else 'process'}: {label}", "failed", "",
                    f"exit codes {[p.returncode for p in procs]}")
            continue
        labels = {d["label"] for d in decisions}
        probes = "; ".join(f"{k} {v.get('status')} {v.get('elapsed_s')} s"
                           for k, v in decisions[0].get("probes", {}).items())
        ctx.add(g, f"2 nodes x 1 {'GPU' if ctx.gpu else 'process'}: {label}",
                ", ".join(f"{d['decided_in_s']:.2f} s" for d in decisions),
                "", f"chose {' / '.join(sorted(labels))} (same on both: {len(labels) == 1}); "
                    f"probes: {probes or 'none'}; launch wall {wall:.1f} s"
                    + (f"; {FAULT}={fault}" if fault else ""))


def group_train1(ctx: Ctx, args: argparse.Namespace) -> None:
    """One GPU (the lent single-GPU kinds): ``resilient-strategy run --nproc-per-node 1`` (the
    supervisor, the hand-off, progress reporting, checkpoints) against the hand-written loop
    under torchrun on the same GPU, the same 100M-parameter MLP, batch and checkpoint cadence."""
    g = "train1"
    if ctx.gpu:
        model = ["--hidden", "4096", "--depth", "7", "--global-batch-size", "512",
                 "--samples", "65536", "--epochs", "2", "--checkpoint-every", "50"]
    else:
        model = ["--hidden", "64", "--depth", "2", "--global-batch-size", "64",
                 "--samples", "4096", "--epochs", "2", "--checkpoint-every", "5"]
    params = 32 * int(model[1]) + (int(model[3]) - 1) * int(model[1]) ** 2 + int(model[1]) * 10
    hand_py = ctx.tmp / "hand_ddp.py"
    hand_py.write_text(HAND_DDP)
    rates: dict[str, list[float]] = {"library": [], "hand": [], "retried": []}
    chose = steps = "?"
    # issue 20: a transient exit on one device is retried on the same device, not stepped down
    backend = "single_device" if ctx.gpu else "cpu"
    fault = f"exit:0:{backend}:60:1" if ctx.gpu else f"exit:0:{backend}:20:1"  # fires once
    faulted: TrainRun | None = None
    frc = 0
    for _ in range(2):  # alternate, so a drifting clock or a warming GPU hits all alike
        rc, lines = run_logged(ctx, [sys.executable, "-m", "resilient_strategy", "run",
                                     "--nproc-per-node", "1", "examples/torch_train.py", *model,
                                     "--checkpoint-dir", tempfile.mkdtemp(dir=ctx.tmp)],
                               ctx.env(RESILIENT_STRATEGY_CACHE_DIR=ctx.cache()), 300)
        run = TrainRun(rc, lines)
        if (x := run.last_rate()) is not None:
            rates["library"].append(x)
        chose, steps = run.chose(), run.steps()
        rc, lines = run_logged(ctx, [sys.executable, "-m", "torch.distributed.run",
                                     "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(hand_py),
                                     *model, "--checkpoint-dir", tempfile.mkdtemp(dir=ctx.tmp)],
                               ctx.env(), 300)
        if (x := TrainRun(rc, lines).last_rate()) is not None:
            rates["hand"].append(x)
        frc, lines = run_logged(ctx, [sys.executable, "-m", "resilient_strategy", "run",
                                      "--nproc-per-node", "1", "examples/torch_train.py", *model,
                                      "--checkpoint-dir", tempfile.mkdtemp(dir=ctx.tmp)],
                                ctx.env(RESILIENT_STRATEGY_CACHE_DIR=ctx.cache(),
                                        RESILIENT_STRATEGY_TRAIN_FAULT=fault), 300)
        faulted = TrainRun(frc, lines)
        if (x := faulted.last_rate()) is not None:  # the epoch after the retry
            rates["retried"].append(x)
    lib = max(rates["library"], default=0.0)
    hand = max(rates["hand"], default=0.0)
    where = "one GPU" if ctx.gpu else "CPU stand-in"
    ctx.add(g, f"run --nproc-per-node 1 ({params:,} params, batch {model[5]}, {where}): "
               "samples/s", f"{lib:,.0f}" if lib else "failed", "",
            f"{chose}; optimizer steps {steps}; runs {[round(x) for x in rates['library']]}")
    ctx.add(g, "hand-written loop under torchrun, same GPU: samples/s",
            f"{hand:,.0f}" if hand else "failed", "",
            f"DDP world 1; runs {[round(x) for x in rates['hand']]}")
    ratio = lib / hand if lib and hand else None
    ctx.add(g, "library's run against the hand-written loop", f"{ratio:.3f}" if ratio else "?",
            (">= 0.99: " + goal(bool(ratio and ratio >= 0.99))) if ctx.gpu else ">= 0.99 on GPUs",
            "best of 2 alternated runs each")
    assert faulted is not None
    run, rc = faulted, frc
    relaunch = run.find(RELAUNCH.pattern)
    where = RELAUNCH.search(relaunch[1]) if relaunch else None
    after = max(rates["retried"], default=0.0)
    kept = bool(after and lib and after >= 0.95 * lib)
    ctx.add(g, f"TRAIN_FAULT={fault} (one device exits once): relaunched as",
            f"{where.group(1)} on {where.group(2)}" if where else f"? (exit {rc})",
            "retrying on the same device: " + goal(bool(where and where.group(1) == "retrying")),
            f"exit code {rc}; optimizer steps {run.steps()} (healthy {steps})")
    ctx.add(g, f"TRAIN_FAULT={fault}: samples/s after the retry against before",
            f"{after / lib:.3f}" if after and lib else "?",
            (">= 0.95: " + goal(kept)) if ctx.gpu else ">= 0.95 on GPUs",
            f"best of 2 alternated runs each: after {after or 0:,.0f} "
            f"(runs {[round(x) for x in rates['retried']]}); healthy {lib:,.0f}")


def suite_counts(logs: Sequence[Path]) -> tuple[dict[str, int], int]:
    """Pytest's closing counts summed over shard logs, and how many logs have none (killed)."""
    counts: dict[str, int] = {}
    killed = 0
    for log_ in logs:
        text = log_.read_text(errors="replace") if log_.exists() else ""
        last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
        if not last or "KeyboardInterrupt" in text:  # the shard's deadline cut it short
            killed += 1
        if not last:
            continue
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                  last[-1]):
            counts[what] = counts.get(what, 0) + int(n)
    return counts, killed


def group_single(ctx: Ctx, args: argparse.Namespace) -> None:
    g = "single"
    has_tf = importlib.util.find_spec("tensorflow") is not None
    logs = [Path(f) for f in args.suite_log]  # the suite ran beforehand (in shards, say)
    if not logs and ctx.gpu:  # in 8 shards, each under a deadline: serially it outlasts a
        shards = ctx.tmp / "suite"  # 10-minute command on a 16-core machine
        run_logged(ctx, ["bash", "benchmarks/gpu_suite_shards.sh", str(shards), "8", "300"],
                   ctx.env(), 360)
        logs = sorted(shards.glob("shard-*.log"))
        for f in logs:
            ctx.log(f"-- {f.name}\n" + "\n".join(
                ln for ln in f.read_text(errors="replace").splitlines()
                if re.match(r"(FAILED|ERROR) |.*\d+ passed|.*KeyboardInterrupt", ln)))
    if logs:
        counts, killed = suite_counts(logs)
        bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
        ctx.add(g, "whole test suite on a GPU machine (RS_GPU_TESTS=1)",
                "passed" if not bad and not killed else f"FAILED ({bad}; unfinished {killed})",
                "passes: " + goal(not bad and not killed),
                ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                + f" over {len(logs)} shard(s); TensorFlow installed: {has_tf}")
    else:
        ctx.add(g, "whole test suite on a GPU machine (RS_GPU_TESTS=1)", NEEDS_GPU)
    health_check(ctx, g, ctx.devices[:1], "GPU health check, one GPU")
    cmd = [sys.executable, "benchmarks/bench_supervisor.py", "--skip-recovery"]
    if ctx.gpu:
        cmd += ["--device", "cuda", "--hidden", "4096"]
    else:
        cmd += ["--steps", "100", "--rounds", "5"]
    rc, lines = run_logged(ctx, cmd, ctx.env(), 600)
    over = next((s for _, s in lines if s.startswith("| overhead per step")), "")
    value = over.split("|")[2].strip() if over else f"failed (exit {rc})"
    ctx.add(g, "progress reporting overhead per step" + ("" if ctx.gpu else " (CPU stand-in)"),
            value, "< 1%", "bench_supervisor.py overhead, " + ("one GPU" if ctx.gpu else "CPU"))


# -- main ---------------------------------------------------------------------------------------

def machine(ctx: Ctx) -> str:
    lines = [f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"resilient_strategy {resilient_strategy.__version__}, python {sys.version.split()[0]}",
             "mode: " + ("GPU" if ctx.gpu else "--cpu-check (gloo/CPU stand-ins, tiny sizes)")]
    if ctx.gpu:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv"],
                             capture_output=True, text=True, check=False).stdout
        lines.append("GPUs: " + "; ".join(out.strip().splitlines()[1:]))
    nccl_vars = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    lines.append(f"NCCL_* as the machine set them (untouched): {nccl_vars or 'none'}")
    return "\n".join(lines)


def table(rows: Sequence[Row]) -> str:
    out = ["| group | measurement | value | goal | detail |", "|---|---|---|---|---|"]
    out += [f"| {r.group} | {r.what} | {r.value} | {r.goal} | {r.detail.replace('|', '/')} |"
            for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-check", action="store_true",
                    help="run every step on CPU with gloo and tiny sizes (no results file)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"groups: {','.join(GROUPS)}")
    ap.add_argument("--timeout", type=float, default=None,
                    help="probe timeout (s); default: the library's (10 s with --cpu-check)")
    ap.add_argument("--out", default=None, help="raw output file (default: see above)")
    ap.add_argument("--no-alternatives", action="store_true",
                    help="train: skip measuring every strategy that works without the backend "
                         "(the chosen-against-best rows; the slowest part, gloo on GPUs)")
    ap.add_argument("--suite-log", action="append", default=[],
                    help="single: pytest logs of the suite already run (shards); not run again")
    args = ap.parse_args()
    groups = [x for x in args.only.split(",") if x]
    if unknown := set(groups) - set(GROUPS):
        ap.error(f"unknown groups {sorted(unknown)}")
    ngpu = 0
    if not args.cpu_check:
        import torch

        ngpu = torch.cuda.device_count()
        if ngpu < 1:
            ap.error("no GPU: the real run needs 2 (1 for the groups "
                     f"{','.join(ONE_GPU_GROUPS)}), or pass --cpu-check")
        if ngpu == 1 and (two := sorted(set(groups) - set(ONE_GPU_GROUPS))):
            ap.error(f"one GPU: groups {two} need 2 (one GPU can run {','.join(ONE_GPU_GROUPS)})")
        gpu_name = torch.cuda.get_device_name(0)
    today = datetime.date.today().isoformat()
    if args.out:
        out = Path(args.out)
    elif args.cpu_check:
        out = Path(tempfile.gettempdir()) / f"gpu-evidence-cpu-check-{today}.md"
    else:
        short = next((w.lower() for w in gpu_name.split() if re.fullmatch(r"[A-Z]+\d+\w*", w)),
                     "gpu")
        out = ROOT / "benchmarks" / "results" / f"{short}x{min(ngpu, 2)}-{today}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout if args.timeout is not None else (10.0 if args.cpu_check else None)
    with tempfile.TemporaryDirectory(prefix="rs-gpu-evidence-") as tmp, \
            out.open("a", encoding="utf-8") as raw:
        ctx = Ctx(gpu=not args.cpu_check, backend="gloo" if args.cpu_check else "nccl",
                  devices=() if args.cpu_check else tuple(range(min(ngpu, 2))),
                  timeout=timeout, raw=raw,
                  tmp=Path(tmp))
        ctx.log(f"\n# GPU evidence ({', '.join(groups)})\n\n```\n{machine(ctx)}")
        steps: dict[str, Callable[[], None]] = {
            "decision": lambda: group_decision(ctx), "fidelity": lambda: group_fidelity(ctx),
            "shm": lambda: group_shm(ctx), "train": lambda: group_train(ctx, args),
            "brokenenv": lambda: group_brokenenv(ctx),
            "multinode": lambda: group_multinode(ctx), "single": lambda: group_single(ctx, args),
            "train1": lambda: group_train1(ctx, args),
        }
        for name in groups:
            t = time.perf_counter()
            ctx.log(f"\n==== {name}")
            try:
                steps[name]()
            except Exception as exc:  # one group's failure must not lose the others' rows
                ctx.add(name, "group failed", type(exc).__name__, "", str(exc)[:200])
            ctx.log(f"==== {name}: {time.perf_counter() - t:.1f} s")
        ctx.log("```\n")
        text = table(ctx.rows)
        ctx.log(text)
    print(f"\nraw output: {out}")
    print(textwrap.dedent(machine_line(args.cpu_check, len(ctx.devices))))
    print(text)


def machine_line(cpu_check: bool, ngpu: int) -> str:
    return ("--cpu-check: gloo between CPU processes stands in for NCCL; rows that need a GPU "
            "say so" if cpu_check else f"{ngpu} GPU(s), NCCL")


if __name__ == "__main__":
    main()
