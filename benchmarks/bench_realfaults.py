"""Real faults against `resilient-strategy run`: what the supervisor concludes, how fast, and what
it leaves behind. Faults made by the kernel or the script, never injected through our own hooks.

    python benchmarks/bench_realfaults.py                       # CPU (gloo), 2 ranks, every row
    python benchmarks/bench_realfaults.py --only sigstop,busy_validation
    python benchmarks/bench_realfaults.py --backend nccl        # 2 GPUs (the lead's run)
    python benchmarks/bench_realfaults.py --src /work/main/src  # another tree (a "before")

Each row starts `resilient-strategy run --nproc-per-node 2` on a small training script (an
MLP, checkpoint every 5 steps, ``--step-s`` seconds of work per step on every rank) with the
default allowance (no --stall-timeout), then makes its fault once (``--at`` is the step):

- ``sigkill`` / ``sigstop``: ``kill -KILL`` / ``kill -STOP`` of rank ``--rank``'s process, found
  by its RANK variable (and this run's tag) in /proc/<pid>/environ;
- ``slow``: that rank 20x slower for ``--slow-steps`` steps (no fault: the job must finish);
- ``busy_validation``: rank 0 runs a validation that burns CPU in the script's own code for
  ``--validate-s`` seconds (longer than the allowance) while the others wait in the next
  all-reduce (no fault: the job must finish);
- ``sleepy_validation``: the same validation asleep (time.sleep): a rank that neither runs nor
  progresses is held up: a stall naming rank 0, resumed; ``RS_VALIDATE``'s ``lock`` (asleep on
  a ``threading.Lock`` another thread of its own holds) and ``flock`` (on a file lock a process
  it started holds) are the same, asleep in the script's own code (``RS_VALIDATE_EVERY=1``:
  on every attempt, not once);
- ``user_connection_reset``: rank ``--rank`` pushes metrics to a server that resets the
  connection, and urllib raises ``ConnectionResetError: [Errno 104] Connection reset by peer``
  in the script's own code: the script's fault, stopped at once with 1 (do not requeue);
- ``device_assert``: the script's own code raises a ``RuntimeError`` with torch's device-side
  assert text (the stand-in for a bad label in a CUDA loss): the script's fault;
- ``comm_error``: rank ``--rank`` alone enters an all-reduce on a gloo group with a 2 s
  timeout, and gloo raises inside torch.distributed while the other rank waits in the next
  gradient all-reduce: the backend's, acted on from the rank's error record.

Columns: seconds from the fault (for a raised error: the time in its error record) to the
supervisor's verdict (its ``fault_seen`` mark), the
verdict and the ranks it names, the action, the step the next attempt resumed from, the exit
code, the wall time and the processes of the run left afterwards. Rows are a table of
scenarios (:data:`SCENARIOS`, name -> function): another fault is one more entry.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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

TAG_VAR = "RS_BENCH_TAG"

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import resilient_strategy
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
    import torch
    marks = os.environ["RS_MARKS"]
    rank = sel.launch.rank
    step_s = float(os.environ.get("RS_STEP_S", "0.05"))
    slow = os.environ.get("RS_SLOW", "")  # "rank:from:to:factor"
    validate = os.environ.get("RS_VALIDATE", "")  # "rank:at:seconds:busy|sleep|lock|flock"
    fault = os.environ.get("RS_RAISE", "")  # "rank:at:urllib|assert|comm"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))
    loader = torch.utils.data.DataLoader(data, batch_size=sel.batch_size, drop_last=True)
    ckpt = sel.checkpoint(sys.argv[1], every_steps=5)
    model, opt, loader = sel.prepare(model, opt, loader)
    side = None
    if fault.endswith(":comm") and sel.num_replicas > 1:
        import datetime
        import torch.distributed as dist
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))

    def push_metrics(step):
        # a metrics server that resets the connection: urllib raises ConnectionResetError
        import socket, threading, urllib.request
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        def hang_up():  # a reset (RST, SO_LINGER 0): ECONNRESET, "Connection reset by peer"
            import struct
            conn, _ = srv.accept()
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
        threading.Thread(target=hang_up, daemon=True).start()
        urllib.request.urlopen(f"http://127.0.0.1:{srv.getsockname()[1]}/m?step={step}", timeout=10)

    def check_labels(step):
        raise RuntimeError("CUDA error: device-side assert triggered\\nCUDA kernel errors might "
                           "be asynchronously reported at some other API call")

    def side_sync(step):
        import torch.distributed as dist
        dist.all_reduce(torch.ones(1), group=side)

    if rank == 0:
        with open(os.path.join(marks, "resumed"), "a") as fh:
            fh.write(f"{sel.optimizer_steps}\\n")
    total = int(os.environ.get("RS_STEPS", "60"))

    def mark(step):
        tmp = os.path.join(marks, f"rank{rank}.step.tmp")
        with open(tmp, "w") as fh:
            fh.write(str(step))
        os.replace(tmp, os.path.join(marks, f"rank{rank}.step"))

    done = False
    for epoch in range(ckpt.epoch, 100):
        sel.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(sel.device), y.to(sel.device)
            step = sel.optimizer_steps + 1
            wait = step_s
            if slow:
                r, a, b, f = slow.split(":")
                if int(r) == rank and int(a) <= step <= int(b):
                    wait = step_s * float(f)
            time.sleep(wait)
            with sel.accumulate(model):
                sel.backward(torch.nn.functional.cross_entropy(model(x), y))
            sel.step(opt)
            mark(sel.optimizer_steps)
            if fault:
                r, at, how = fault.split(":")
                flag = os.path.join(marks, "raised")
                if int(r) == rank and sel.optimizer_steps == int(at) and not os.path.exists(flag):
                    with open(flag, "w") as fh:
                        fh.write(str(time.time()))
                    {"urllib": push_metrics, "assert": check_labels, "comm": side_sync}[how](
                        sel.optimizer_steps)
            if validate:
                r, at, secs, how = validate.split(":")
                flag = os.path.join(marks, "validated")
                again = os.environ.get("RS_VALIDATE_EVERY") == "1"  # on every attempt
                if int(r) == rank and sel.optimizer_steps == int(at) and (
                        again or not os.path.exists(flag)):
                    open(flag, "w").close()
                    end = time.monotonic() + float(secs)
                    if how == "sleep":
                        time.sleep(float(secs))
                    elif how == "lock":  # asleep on a lock another thread of its own holds
                        import threading
                        lock, held = threading.Lock(), threading.Event()
                        def hold():
                            with lock:
                                held.set()
                                time.sleep(float(secs))
                        threading.Thread(target=hold, daemon=True).start()
                        held.wait()
                        with lock:
                            pass
                    elif how == "flock":  # asleep on a file lock a process it started holds
                        import subprocess
                        path = os.path.join(marks, "lockfile")
                        holder = subprocess.Popen(
                            [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], "
                             "'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
                             "time.sleep(float(sys.argv[2]))", path, secs],
                            stdout=subprocess.PIPE, text=True)
                        holder.stdout.readline()
                        import fcntl
                        with open(path, "w") as fh:
                            fcntl.flock(fh, fcntl.LOCK_EX)
                    else:
                        with torch.no_grad():
                            while time.monotonic() < end:
                                model(torch.randn(256, 32, device=sel.device)).sum().item()
            if sel.optimizer_steps >= total:
                done = True
                break
        if done:
            break
    print("finished", rank, sel.optimizer_steps, flush=True)
    self_stop(rank, marks)  # RS_SELF_STOP=<rank>: a real SIGSTOP after the last step
    sel.shutdown()
""")

#: The script's own SIGSTOP of its process (``RS_SELF_STOP=<rank>``, once per run: a flag in
#: the marks), for a fault at a moment no outside signal can hit reliably (after the last
#: step, before the teardown); the kernel stops it as it does for ``kill -STOP``.
SELF_STOP = textwrap.dedent("""
    def self_stop(rank, marks):
        import os, signal, time
        want = os.environ.get("RS_SELF_STOP", "")
        flag = os.path.join(marks, "self_stopped")
        if want == "" or int(want) != rank or os.path.exists(flag):
            return
        with open(flag, "w") as fh:
            fh.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
""")

#: The same job in Keras (``--framework keras``): one supervised process, model.fit with the
#: selection's callbacks (its progress reports), BackupAndRestore every 5 batches, each batch
#: ``RS_STEP_S`` of work in the script's own callback and marked as the torch script marks.
KERAS_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import resilient_strategy
    sel = resilient_strategy.resilient_strategy(framework="tensorflow", global_batch_size=64)
    import keras
    marks = os.environ["RS_MARKS"]
    rank = 0
    step_s = float(os.environ.get("RS_STEP_S", "0.05"))
    total = int(os.environ.get("RS_STEPS", "60"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * total, 32)).astype("float32")
    y = rng.integers(0, 4, size=(64 * total,)).astype("int32")
    with sel.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="gelu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(**sel.optimizer_kwargs(learning_rate=0.05)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Mark(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            time.sleep(step_s)

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            tmp = os.path.join(marks, f"rank{rank}.step.tmp")
            with open(tmp, "w") as fh:
                fh.write(str(step))
            os.replace(tmp, os.path.join(marks, f"rank{rank}.step"))

    with open(os.path.join(marks, "resumed"), "a") as fh:
        fh.write("0\\n")
    model.fit(x, y, batch_size=sel.batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[Mark(), *sel.callbacks(backup_dir=sys.argv[1], save_freq=5)])
    print("finished", rank, flush=True)
    self_stop(rank, marks)
""")



@dataclass
class Row:
    scenario: str
    fault_to_verdict_s: float | None = None
    verdict: str = "ok"
    #: a stall's kind (stopped, asleep, straggler, ...): the verdict's ``stall``
    stall: str = ""
    ranks: list[int] = field(default_factory=list)
    action: str = "finish"
    resumed_from: int | None = None
    exit_code: int = 0
    wall_s: float = 0.0
    left: int = 0
    note: str = ""
    #: the job's goodput (its summary line) and its largest badput parts (attempts.json)
    goodput: float | None = None
    badput: str = ""

    def cells(self) -> list[str]:
        ftv = "-" if self.fault_to_verdict_s is None else f"{self.fault_to_verdict_s:.1f}"
        ranks = ",".join(map(str, self.ranks)) or "-"
        resumed = "-" if self.resumed_from is None else str(self.resumed_from)
        good = "-" if self.goodput is None else f"{self.goodput:.1f}%"
        verdict = f"{self.verdict} ({self.stall})" if self.stall else self.verdict
        return [self.scenario, ftv, verdict, ranks, self.action, resumed,
                str(self.exit_code), f"{self.wall_s:.1f}", str(self.left), good,
                self.badput or "-", self.note]


HEADER = ["scenario", "fault->verdict s", "verdict", "ranks", "action", "resumed from",
          "exit", "wall s", "left", "goodput", "badput s", "note"]


@dataclass
class Run:
    """One supervised run in its own directory, with its tag in every process's environment."""

    args: argparse.Namespace
    tmp: Path
    env_extra: dict[str, str]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen[str] | None = None
    started: float = 0.0
    #: the attempt whose verdict the row reports (0: the first; 1 after a step-down)
    judged: int = 0

    def start(self) -> None:
        marks = self.tmp / "marks"
        marks.mkdir(parents=True, exist_ok=True)
        script = self.tmp / "train.py"
        keras = getattr(self.args, "framework", "torch") == "keras"
        script.write_text(SELF_STOP + (KERAS_SCRIPT if keras else SCRIPT))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                    or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}  # the caller's, as given
        (self.tmp / "tmp").mkdir(exist_ok=True)
        env.update({"PYTHONPATH": self.args.src, TAG_VAR: self.tag, "RS_MARKS": str(marks),
                    "RS_STEP_S": str(self.args.step_s), "RS_STEPS": str(self.args.steps),
                    "TMPDIR": str(self.tmp / "tmp"),
                    "RESILIENT_STRATEGY_CACHE_DIR": str(self.args.cache),
                    **self.env_extra})
        if self.args.backend == "gloo":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if keras:
            env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node",
             str(getattr(self.args, "nproc", 2)),
             *self.args.run_args, str(script), str(self.tmp / "ckpt")],
            env=env, cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def step_of(self, rank: int) -> int:
        try:
            return int((self.tmp / "marks" / f"rank{rank}.step").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def wait_step(self, rank: int, step: int, deadline_s: float = 240.0) -> bool:
        end = time.monotonic() + deadline_s
        assert self.proc is not None
        while time.monotonic() < end and self.proc.poll() is None:
            if self.step_of(rank) >= step:
                return True
            time.sleep(0.02)
        return False

    def rank_pids(self, rank: int) -> list[int]:
        """By RANK in /proc/<pid>/environ; else (``--warm-start``: a forked worker's environ is
        its fork server's) by the pid each worker writes to its attempt's directory."""
        found = pids_with_env({TAG_VAR: self.tag, "RANK": str(rank)})
        if found or self.proc is None:
            return found
        return run_rank_pids(self.tmp / "tmp", self.proc.pid, rank)

    def finish(self, row: Row, fault_at: float | None) -> Row:
        assert self.proc is not None
        try:
            out, _ = self.proc.communicate(timeout=self.args.deadline)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=30)
            row.note = "deadline"
        (self.tmp / "output.txt").write_text(out)
        row.exit_code = self.proc.returncode
        row.wall_s = time.time() - self.started
        time.sleep(0.5)
        left = pids_with_env({TAG_VAR: self.tag})
        row.left = len(left)
        for pid in left:  # never leave them behind us
            with_cont(pid)
        said = re.search(r"goodput ([0-9.]+)% of", out or "")
        row.goodput = float(said.group(1)) if said else None
        found = list((self.tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
        if found:
            record = json.loads(found[0].read_text())
            parts = {k: v for k, v in (record.get("goodput") or {}).items()
                     if k.endswith("_s") and k not in ("wall_s", "productive_s")}
            row.badput = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in sorted(
                parts.items(), key=lambda kv: -kv[1])[:3] if v >= 0.05)
            attempts = record["attempts"]
            first = attempts[min(self.judged, len(attempts) - 1)]
            row.verdict = first["verdict"]["kind"]
            row.stall = str(first["verdict"].get("stall") or "")
            row.ranks = list(first["verdict"].get("ranks", []))
            row.action = first["action"]
            seen = ((first.get("times") or {}).get("supervisor") or {}).get("fault_seen")
            if fault_at is not None and seen is not None:
                row.fault_to_verdict_s = round(float(seen) - fault_at, 2)
            if len(attempts) > self.judged + 1:
                row.resumed_from = attempts[self.judged + 1].get("resumed_from")
        return row


def with_cont(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except OSError:
            return


def _signal_row(name: str, sig: signal.Signals) -> Callable[[argparse.Namespace, Path], Row]:
    def scenario(args: argparse.Namespace, tmp: Path) -> Row:
        run = Run(args, tmp, {})
        run.start()
        row = Row(name)
        fault_at = None
        if run.wait_step(args.rank, args.at):
            for pid in run.rank_pids(args.rank):
                os.kill(pid, sig)
            fault_at = time.time()
        else:
            row.note = "the fault was never made"
        return run.finish(row, fault_at)
    return scenario


def self_stop(args: argparse.Namespace, tmp: Path) -> Row:
    """Rank ``--rank`` stops itself (SIGSTOP) after its last step, before ``sel.shutdown()``:
    the others wait for it in the teardown's barrier. The fault's time is its mark."""
    run = Run(args, tmp, {"RS_SELF_STOP": str(args.rank)})
    run.start()
    row = run.finish(Row("sigstop_after_last_step"), None)
    attempts = list((tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
    try:
        at = float((tmp / "marks" / "self_stopped").read_text())
    except (OSError, ValueError):
        row.note = "the fault was never made"
        return row
    if attempts:
        first = json.loads(attempts[0].read_text())["attempts"][0]
        seen = ((first.get("times") or {}).get("supervisor") or {}).get("fault_seen")
        if seen is not None:
            row.fault_to_verdict_s = round(float(seen) - at, 2)
    return row


def sigstop_after_step_down(args: argparse.Namespace, tmp: Path) -> Row:
    """Rank 1 raises a (rehearsed) communication error on gloo at step ``--at`` - 4: the job
    steps down to one CPU process; that one remaining rank is stopped at step ``--at``. The
    row reports the second attempt's verdict."""
    run = Run(args, tmp, {"RESILIENT_STRATEGY_TRAIN_FAULT": f"error:1:gloo:{args.at - 4}:1"},
              judged=1)
    run.start()
    row = Row("sigstop_after_step_down")
    fault_at = None
    end = time.monotonic() + 240.0
    resumed = tmp / "marks" / "resumed"
    while time.monotonic() < end and run.proc is not None and run.proc.poll() is None:
        if resumed.exists() and len(resumed.read_text().split()) >= 2:
            break
        time.sleep(0.05)
    if run.wait_step(0, args.at) and len(resumed.read_text().split()) >= 2:
        for pid in run.rank_pids(0):
            os.kill(pid, signal.SIGSTOP)
        fault_at = time.time()
    else:
        row.note = "the fault was never made"
    return run.finish(row, fault_at)


def slow(args: argparse.Namespace, tmp: Path) -> Row:
    run = Run(args, tmp, {"RS_SLOW": f"{args.rank}:{args.at}:{args.at + args.slow_steps}:20"})
    run.start()
    return run.finish(Row("slow_20x"), None)


def _validation(how: str, name: str) -> Callable[[argparse.Namespace, Path], Row]:
    def scenario(args: argparse.Namespace, tmp: Path) -> Row:
        run = Run(args, tmp, {"RS_VALIDATE": f"0:{args.at}:{args.validate_s}:{how}"})
        run.start()
        row = Row(name)
        fault_at = None
        if run.wait_step(0, args.at):
            fault_at = time.time()  # the validation begins as the step is marked
        return run.finish(row, fault_at)
    return scenario


def _raised(name: str, how: str) -> Callable[[argparse.Namespace, Path], Row]:
    """A rank raises from the script (``how``: urllib, assert, comm). The fault's time is when
    the script called the failing code (the ``raised`` mark; the comm row's error comes 2 s later,
    at gloo's timeout), so that a tree without error-record copies (a "before") is measured the
    same way."""
    def scenario(args: argparse.Namespace, tmp: Path) -> Row:
        run = Run(args, tmp, {"RS_RAISE": f"{args.rank}:{args.at}:{how}"})
        run.start()
        row = run.finish(Row(name), None)
        attempts = list((tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
        try:
            at = float((tmp / "marks" / "raised").read_text())
        except (OSError, ValueError):
            row.note = "the fault was never made"
            return row
        if attempts:
            first = json.loads(attempts[0].read_text())["attempts"][0]
            seen = ((first.get("times") or {}).get("supervisor") or {}).get("fault_seen")
            if seen is not None:
                row.fault_to_verdict_s = round(float(seen) - at, 2)
            v = first["verdict"]
            row.note = f"seen: {v.get('seen') or '-'}, blame: {v.get('blame') or '-'}"
        return row
    return scenario


#: The fault scenarios, by name (one row each; another fault is one more entry).
SCENARIOS: dict[str, Callable[[argparse.Namespace, Path], Row]] = {
    "sigkill": _signal_row("sigkill", signal.SIGKILL),
    "sigstop": _signal_row("sigstop", signal.SIGSTOP),
    "sigstop_after_last_step": self_stop,
    "sigstop_after_step_down": sigstop_after_step_down,
    "slow": slow,
    "busy_validation": _validation("busy", "busy_validation"),
    "sleepy_validation": _validation("sleep", "sleepy_validation"),
    "user_connection_reset": _raised("user_connection_reset", "urllib"),
    "device_assert": _raised("device_assert", "assert"),
    "comm_error": _raised("comm_error", "comm"),
}


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--nproc", type=int, default=2, help="--nproc-per-node of the run")
    p.add_argument("--framework", choices=("torch", "keras"), default="torch",
                   help="the training script: torch's, or Keras' (one process)")
    p.add_argument("--rank", type=int, default=1, help="the rank the fault hits")
    p.add_argument("--at", type=int, default=12, help="the step the fault comes at")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--slow-steps", type=int, default=10)
    p.add_argument("--validate-s", type=float, default=30.0)
    p.add_argument("--deadline", type=float, default=400.0)
    p.add_argument("--src", default=str(ROOT / "src"), help="the tree to run (PYTHONPATH)")
    p.add_argument("--run-arg", action="append", default=[], dest="run_args",
                   help="one more argument for `resilient-strategy run` (repeatable)")
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rs-realfaults-") as top:
        args.cache = Path(top) / "cache"
        for name in names:
            row = SCENARIOS[name](args, Path(top) / name)
            print(table([row]).splitlines()[-1], flush=True)
            rows.append(row)
    print(f"\n{args.framework}, backend {args.backend}, {args.nproc} rank(s), "
          f"fault on rank {args.rank} at step {args.at}, "
          f"{args.step_s} s per step, src {args.src}\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
