"""Goodput under real faults, three ways: `resilient-strategy run`, `torchrun --max-restarts N`
with its defaults, and unsupervised (`torchrun`, no restarts) (issue 33, item 2).

    python benchmarks/bench_goodput.py                         # CPU: gloo, 2 ranks (< 6 min)
    python benchmarks/bench_goodput.py --device cuda           # 2 GPUs: NCCL
    python benchmarks/bench_goodput.py --only kill,stop --ways library,torchrun

The job: a small DDP training script (an MLP, ``--step-s`` seconds of work per step on every
rank, ``--steps`` optimizer steps, a checkpoint every ``--every`` steps, exact resume: each
step's batch is a function of the step). Under `resilient-strategy run` it is written with the
library (`resilient_strategy()`, ``sel.prepare``, ``sel.checkpoint``); under torchrun it is the
same loop written by hand (``init_process_group`` with torch's default timeout, DDP,
``torch.save`` every ``--every`` steps), which is what a user runs without the library.

The schedule of real faults, one job per fault and way, each made once at step ``--at``:

- ``kill``: ``kill -KILL`` of rank 1's process (found by its RANK variable, machine/procs.py);
- ``stop``: ``kill -STOP`` of rank 1's process: the other rank waits in the next all-reduce;
- ``comm``: rank 1 alone enters an all-reduce on a gloo group with a 2 s timeout, and
  torch.distributed raises (a communication error);
- ``env``: rank 1 is killed and the relaunch's environment breaks the backend: the relaunched
  workers find a bad ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME`` on GPUs), an interface that
  does not exist, so the process group cannot be set up again.

One job per fault rather than four faults in one job: a hang under torchrun's defaults, or the
library stepping down to one process after a backend failure, would hide every later fault.

Per job, measured from outside (every way the same): the wall time; the productive step time
(the steps that count, each once, at the job's healthy step time: the median of its first
attempt's steps before the fault, from rank 0's step marks; in brackets the same steps as long
as they took, which a slower strategy after a step-down makes longer); goodput
(productive / wall); and the fault's badput split into detection + stop (from the fault until
every worker process of the faulted attempt is gone), restart (until the first step of the
next attempt) and lost work (until the step the job had reached at the fault is reached
again). A job in which nothing happened for ``--hang-s`` seconds after its fault (no worker
started or ended, no step marked) is stopped and its fault's badput reported as "> N s", the
seconds from the fault to that stop (torch's default timeout for a gloo collective is 30
minutes, for NCCL 10 minutes: pytorch/pytorch#110947); one whose launcher gave up is "job
lost". Under the library, its own accounting (the summary line's goodput) is shown next to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from resilient_strategy.machine.procs import pids_with_env  # noqa: E402
from resilient_strategy.run.warm import run_rank_pids  # noqa: E402

TAG_VAR = "RS_GOODPUT_TAG"
BAD_IFNAME = "rsbench0"  # an interface no machine has

SCRIPT = textwrap.dedent("""
    import os, sys, time
    marks = os.environ["RS_MARKS"]
    device_kind = os.environ.get("RS_DEVICE", "cpu")
    if os.path.exists(os.path.join(marks, "broken_env")):  # the relaunch's environment breaks
        os.environ["NCCL_SOCKET_IFNAME" if device_kind == "cuda" else "GLOO_SOCKET_IFNAME"] = (
            os.environ["RS_BAD_IFNAME"])
    library = os.environ["RS_MODE"] == "library"
    step_s = float(os.environ["RS_STEP_S"])
    total = int(os.environ["RS_STEPS"])
    every = int(os.environ["RS_EVERY"])
    comm_at = os.environ.get("RS_COMM_AT", "")  # "rank:step"
    ckpt_dir = sys.argv[1]
    if library:
        import resilient_strategy
        sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
        rank, world = sel.launch.rank, sel.num_replicas
    import datetime
    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if library:
        ckpt = sel.checkpoint(ckpt_dir, every_steps=every)
        model, opt, _ = sel.prepare(model, opt)
        device, micro, accum = sel.device, sel.per_replica_batch_size, sel.accumulation_steps
        done = sel.optimizer_steps
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device_kind == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)  # torch's default timeout
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model.to(device))
        micro, accum, done = 64 // world, 1, 0
        path = os.path.join(ckpt_dir, "last.pt")
        if os.path.exists(path):
            state = torch.load(path, map_location=device, weights_only=True)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            done = int(state["step"])
    side = None
    if comm_at and world > 1:
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    log = open(os.path.join(marks, "steps.log"), "a") if rank == 0 else None

    def mark(step):
        tmp = os.path.join(marks, f"rank{rank}.step.tmp")
        with open(tmp, "w") as fh:
            fh.write(str(step))
        os.replace(tmp, os.path.join(marks, f"rank{rank}.step"))
        if log is not None:
            log.write(f"{step} {time.time():.4f} {os.getpid()}\\n")
            log.flush()

    for step in range(done + 1, total + 1):
        for m in range(accum):  # each step's batch is a function of the step: exact resume
            g = torch.Generator().manual_seed(step * 64 + rank * accum + m)
            x = torch.randn(micro, 32, generator=g).to(device)
            y = torch.randint(0, 4, (micro,), generator=g).to(device)
            time.sleep(step_s / accum)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if library:
                with sel.accumulate(model):
                    sel.backward(loss)
            else:
                loss.backward()
        if library:
            sel.step(opt)
        else:
            opt.step()
            opt.zero_grad()
            if rank == 0 and step % every == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
                tmp = path + ".tmp"
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, path)
        mark(step)
        if side is not None:
            r, at = (int(v) for v in comm_at.split(":"))
            flag = os.path.join(marks, "raised")
            if rank == r and step == at and not os.path.exists(flag):
                with open(flag, "w") as fh:
                    fh.write(str(time.time()))
                dist.all_reduce(torch.ones(1), group=side)  # alone: raises at the 2 s timeout
    if library:
        sel.shutdown()
    else:
        dist.destroy_process_group()
""")


@dataclass
class Result:
    way: str
    fault: str
    outcome: str = "finished"
    wall_s: float = 0.0
    steps: int = 0
    productive_s: float = 0.0
    fault_step: int | None = None
    #: from the fault: every process of the faulted attempt gone; the next attempt's first step;
    #: the fault's step reached again (None: never)
    stopped_s: float | None = None
    restarted_s: float | None = None
    recovered_s: float | None = None
    capped: bool = False
    #: the healthy step time (first attempt's median) and the counted steps as long as they took
    step_s: float = 0.0
    counted_s: float = 0.0
    #: seconds from the fault to the job's end (capped: to the bench stopping it)
    after_s: float = 0.0
    library_goodput: float | None = None
    note: str = ""

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def badput(self) -> str:
        if self.fault_step is None:
            return "-"
        if self.recovered_s is not None:
            return f"{self.recovered_s:.1f}"
        return f"> {self.after_s:.0f}" if self.capped else "job lost"

    def split(self) -> str:
        parts = []
        for label, at, before in (("detect+stop", self.stopped_s, 0.0),
                                  ("restart", self.restarted_s, self.stopped_s),
                                  ("lost work", self.recovered_s, self.restarted_s)):
            if at is None or before is None:
                break
            parts.append(f"{label} {at - before:.1f}")
        return ", ".join(parts) or "-"

    def cells(self) -> list[str]:
        good = f"{100 * self.goodput:.1f}%" + (" (at most)" if self.capped else "")
        lib = "-" if self.library_goodput is None else f"{self.library_goodput:.1f}%"
        return [self.way, self.fault, self.outcome, f"{self.wall_s:.1f}", str(self.steps),
                f"{self.productive_s:.1f} ({self.counted_s:.1f})", good, self.badput(),
                self.split(), lib, self.note]


HEADER = ["way", "fault", "outcome", "wall s", "steps", "productive s (as run)", "goodput",
          "fault badput s", "split s", "library's own goodput", "note"]


@dataclass
class Job:
    args: argparse.Namespace
    way: str
    tmp: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen[str] | None = None
    started: float = 0.0

    @property
    def marks(self) -> Path:
        return self.tmp / "marks"

    def start(self) -> None:
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.tmp / "tmp").mkdir(exist_ok=True)
        script = self.tmp / "train.py"
        script.write_text(SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                    or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}  # the caller's, as given
        env.update({"PYTHONPATH": self.args.src, TAG_VAR: self.tag, "RS_MARKS": str(self.marks),
                    "RS_DEVICE": self.args.device, "RS_BAD_IFNAME": BAD_IFNAME,
                    "RS_MODE": "library" if self.way == "library" else "plain",
                    "RS_STEP_S": str(self.args.step_s), "RS_STEPS": str(self.args.steps),
                    "RS_EVERY": str(self.args.every), "TMPDIR": str(self.tmp / "tmp"),
                    "RESILIENT_STRATEGY_CACHE_DIR": str(self.args.cache), **self.env_extra})
        if self.args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        ckpt = str(self.tmp / "ckpt")
        if self.way == "library":
            argv = [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "2",
                    str(script), ckpt]
        else:
            restarts = ["--max-restarts", str(self.args.max_restarts)] \
                if self.way == "torchrun" else []
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", *restarts, str(script), ckpt]
        self.started = time.time()
        # a file, not a pipe: a stopped worker left behind would hold a pipe open
        with open(self.tmp / "output.txt", "w") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=self.tmp, stdout=out,
                                         stderr=subprocess.STDOUT, text=True)

    def step_of(self, rank: int) -> int:
        try:
            return int((self.marks / f"rank{rank}.step").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def wait_step(self, rank: int, step: int, deadline_s: float) -> bool:
        assert self.proc is not None
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and self.proc.poll() is None:
            if self.step_of(rank) >= step:
                return True
            time.sleep(0.01)
        return False

    def rank_pids(self, rank: int) -> list[int]:
        """By RANK in /proc/<pid>/environ; else (run's warm start: a forked worker's environ is
        its fork server's) by the pid each worker writes to its attempt's directory."""
        found = pids_with_env({TAG_VAR: self.tag, "RANK": str(rank)})
        if found or self.proc is None:
            return found
        return run_rank_pids(self.tmp / "tmp", self.proc.pid, rank)

    def workers(self) -> list[int]:
        return [p for r in (0, 1) for p in self.rank_pids(r)]

    def _log_size(self) -> int:
        try:
            return (self.marks / "steps.log").stat().st_size
        except OSError:
            return 0

    def finish(self, res: Result, fault_at: float | None, workers: list[int]) -> Result:
        """Wait for the job to end: after its fault, stop it once nothing happened for
        ``--hang-s`` seconds (no worker started or ended, no step marked); in all, by
        ``--deadline``."""
        assert self.proc is not None
        end_by = self.started + self.args.deadline
        stopped_at = None
        last_event, seen, size = time.time(), frozenset(workers), -1
        while self.proc.poll() is None and time.time() < end_by:
            now = time.time()
            if stopped_at is None and workers and not any(_alive(p) for p in workers):
                stopped_at = now
            state = frozenset(self.workers()), self._log_size()
            if state != (seen, size):
                last_event, (seen, size) = now, state
            if fault_at is not None and now - last_event > self.args.hang_s:
                break
            time.sleep(0.05)
        if self.proc.poll() is None:
            res.capped = True
            res.after_s = time.time() - (fault_at or self.started)
            _end(self.proc)
        self.proc.wait(timeout=30)
        end = time.time()
        if stopped_at is None and workers and not res.capped:
            stopped_at = end
        left = pids_with_env({TAG_VAR: self.tag})
        for pid in left:  # never leave any behind
            _cont_kill(pid)
        if left:
            res.note = f"{len(left)} worker(s) left behind by the launcher (killed by the bench)"
        out = (self.tmp / "output.txt").read_text(errors="replace")
        res.wall_s = end - self.started
        code = self.proc.returncode
        if res.capped:
            res.outcome = f"no progress for {self.args.hang_s:.0f} s: stopped by the bench"
        elif code != 0:
            res.outcome = f"failed (exit {code})"
        self._account(res, fault_at, stopped_at)
        said = re.search(r"goodput ([0-9.]+)% of", out)
        res.library_goodput = float(said.group(1)) if said else None
        return res

    def _account(self, res: Result, fault_at: float | None, stopped_at: float | None) -> None:
        lines = []
        try:
            for line in (self.marks / "steps.log").read_text().splitlines():
                step, at, pid = line.split()
                lines.append((int(step), float(at), int(pid)))
        except (OSError, ValueError):
            pass
        # each step that counts once: its last run, at its own duration (from the step before
        # it in the same process); an attempt's first step at the job's median step time
        last: dict[int, tuple[float, int]] = {}
        durations: dict[int, float | None] = {}  # each step's last run, as long as it took
        prev: dict[int, float] = {}
        for step, at, pid in lines:
            last[step] = (at, pid)
            durations[step] = at - prev[pid] if pid in prev else None
            prev[pid] = at
        # the job's healthy step time: the median of its first attempt's steps (before the fault)
        first_pid = lines[0][2] if lines else None
        healthy = [at - prev_at for (_, prev_at, p0), (_, at, p1) in itertools.pairwise(lines)
                   if p0 == p1 == first_pid and (fault_at is None or at <= fault_at)]
        res.step_s = statistics.median(healthy) if healthy else 0.0
        res.steps = max(last, default=0)
        res.productive_s = len(last) * res.step_s
        res.counted_s = sum(res.step_s if d is None else d for d in durations.values())
        if fault_at is None:
            return
        before = [s for s, at, _ in lines if at <= fault_at]
        res.fault_step = max(before, default=0)
        if stopped_at is not None:
            res.stopped_s = stopped_at - fault_at
            after = [at for _, at, _ in lines if at > stopped_at]
            if after:
                res.restarted_s = min(after) - fault_at
            back = [at for s, at, _ in lines if at > stopped_at and s >= res.fault_step]
            if back:
                res.recovered_s = min(back) - fault_at
        if not res.capped:
            res.after_s = self.started + res.wall_s - fault_at


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cont_kill(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except OSError:
            return


def _end(proc: subprocess.Popen[str]) -> None:
    """Stop a launcher (SIGTERM: torchrun and `run` stop their workers), SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _signal(sig: signal.Signals, broken_env: bool = False
            ) -> Callable[[Job], tuple[float | None, list[int]]]:
    def make(job: Job) -> tuple[float | None, list[int]]:
        if not job.wait_step(1, job.args.at, job.args.deadline):
            return None, []
        workers = job.workers()
        if broken_env:
            (job.marks / "broken_env").write_text("1")
        for pid in job.rank_pids(1):
            os.kill(pid, sig)
        return time.time(), workers
    return make


def _comm(job: Job) -> tuple[float | None, list[int]]:
    if not job.wait_step(1, job.args.at, job.args.deadline):
        return None, []
    workers = job.workers()
    end = time.monotonic() + 30
    while time.monotonic() < end and not (job.marks / "raised").exists():
        time.sleep(0.01)
    try:  # the fault is the moment rank 1 entered the lone all-reduce
        return float((job.marks / "raised").read_text()), workers
    except (OSError, ValueError):
        return None, workers


#: The schedule of faults, by name: how each is made (another fault is one more entry).
FAULTS: dict[str, Callable[[Job], tuple[float | None, list[int]]]] = {
    "kill": _signal(signal.SIGKILL),
    "stop": _signal(signal.SIGSTOP),
    "comm": _comm,
    "env": _signal(signal.SIGKILL, broken_env=True),
}
WAYS = ("library", "torchrun", "unsupervised")


def run_one(args: argparse.Namespace, way: str, fault: str, tmp: Path) -> Result:
    extra = {"RS_COMM_AT": f"1:{args.at}"} if fault == "comm" else {}
    job = Job(args, way, tmp, extra)
    job.start()
    try:
        fault_at, workers = FAULTS[fault](job)
        res = Result(way, fault)
        if fault_at is None:
            res.note = "the fault was never made"
        return job.finish(res, fault_at, workers)
    finally:  # interrupted too: no process of the job outlives it
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
        for pid in pids_with_env({TAG_VAR: job.tag}):
            _cont_kill(pid)


def _keep(src: Path, dst: Path) -> None:
    """Copy a job's output, step marks and evidence (never its checkpoints)."""
    for f in [src / "output.txt", src / "marks" / "steps.log",
              *src.glob("resilient-strategy-evidence/*/*")]:
        if f.is_file():
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())


def table(rows: list[Result]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def per_way(rows: list[Result]) -> str:
    lines = ["| way | jobs | wall s (sum) | productive s (sum) | goodput | faults recovered |",
             "|---|---|---|---|---|---|"]
    for way in WAYS:
        mine = [r for r in rows if r.way == way]
        if not mine:
            continue
        wall = sum(r.wall_s for r in mine)
        prod = sum(r.productive_s for r in mine)
        capped = any(r.capped for r in mine)
        back = sum(1 for r in mine if r.recovered_s is not None)
        lines.append(f"| {way} | {len(mine)} | {wall:.1f}{'+' if capped else ''} | {prod:.1f} | "
                     f"{100 * prod / wall if wall else 0:.1f}%{' (at most)' if capped else ''} | "
                     f"{back} of {len(mine)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--only", default="", help="comma-separated faults (kill,stop,comm,env)")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--at", type=int, default=15, help="the step the fault comes at")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun's --max-restarts")
    p.add_argument("--hang-s", type=float, default=30.0,
                   help="after the fault, stop a job in which nothing happened this long")
    p.add_argument("--deadline", type=float, default=240.0,
                   help="seconds a job may take in all (to reach its fault, to finish)")
    p.add_argument("--src", default=str(ROOT / "src"), help="the tree to run (PYTHONPATH)")
    p.add_argument("--out", default="", help="also write the tables here")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--keep", default="", help="copy each job's output and marks here")
    args = p.parse_args(argv)
    faults = [f for f in args.only.split(",") if f] or list(FAULTS)
    ways = [w for w in args.ways.split(",") if w]
    rows: list[Result] = []
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM cleans up too
    with tempfile.TemporaryDirectory(prefix="rs-goodput-") as top:
        args.cache = Path(top) / "cache"
        for fault in faults:
            for way in ways:
                row = run_one(args, way, fault, Path(top) / f"{way}-{fault}")
                if args.keep:
                    _keep(Path(top) / f"{way}-{fault}", Path(args.keep) / f"{way}-{fault}")
                print(table([row]).splitlines()[-1], flush=True)
                rows.append(row)
    text = (f"device {args.device}, 2 ranks, {args.steps} steps of {args.step_s} s, checkpoint "
            f"every {args.every} steps, the fault on rank 1 at step {args.at}; torchrun "
            f"--max-restarts {args.max_restarts}; a job with no progress {args.hang_s:.0f} s "
            f"after its fault stopped; {time.monotonic() - t0:.0f} s in all; src {args.src}\n\n"
            + table(rows) + "\n\n" + per_way(rows))
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
