"""One attempt without torch: the one process of a TensorFlow job (one process drives every
device there), started, watched and stopped as torch's elastic agent does it for its workers
(`agent`), for an install that has no torch.

- started as `worker` (the handoff environment, its stacks on SIGUSR1, its error record,
  dying with this supervisor however it dies), in its own session
  (`start_supervised`), stderr to the console and to
  ``logs/0/stderr.log`` as torch's agent tees it;
- watched by the same `TrainingWatch` on its progress records, every
  `MONITOR_S` (torchrun's monitor interval);
- on a stall, its stacks asked for first (`dump_stacks`; not of a stopped process, which
  cannot write them), then stopped (a stopped process SIGKILLed at once: `stop_stopped`) with
  the runner's bounded stop (SIGTERM to its process group, `STOP_GRACE_S`, SIGKILL, reaped:
  `stop_groups`); on a signal to this supervisor too
  (raised as `SignalException`, as torch's agent raises its own).

The verdict is `classify_attempt`'s, from the same stall, exit, error record,
progress record and stderr tail torch's path reads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO

from ..core.call.options import RunOptions
from ..errors import ResilientStrategyError
from ..machine import env
from ..probing.proc import start_supervised, stop_groups
from ..records.handoff import HandedDecision
from ..records.progress import Stall, read_record
from ..records.rundir import RunDir
from .agent import _read_json, _stderr_tail, dump_stacks, raised_before, stop_stopped
from .verdicts import RankExit, Verdict, classify_attempt
from .watch import TrainingWatch

#: How often the worker's progress is judged (torchrun's ``--monitor-interval`` default).
MONITOR_S = 0.1
#: SIGTERM to SIGKILL, and SIGKILL to giving up on the reap (torch's agent's shutdown timeout).
STOP_GRACE_S = 30.0
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


class SignalException(Exception):
    """A signal stopped this supervisor while the worker ran (the worker is stopped first); the
    supervisor answers it as it answers torch's agent's exception of the same name."""

    def __init__(self, sigval: int) -> None:
        super().__init__(f"stopped by signal {sigval}")
        self.sigval = sigval


def launch_one(opts: RunOptions, decision: HandedDecision, *, poll_s: float = MONITOR_S,
               grace_s: float = STOP_GRACE_S) -> Verdict:
    """One attempt of a one-process decision: start, watch, stop, classify."""
    if decision.processes != 1 or decision.nodes != 1:
        raise ResilientStrategyError(
            f"{decision.label or decision.chosen} needs {decision.processes} processes on "
            f"{decision.nodes} node(s): without torch, resilient-strategy run starts one "
            "(pip install torch for torch's elastic agent)")
    run_dir = RunDir(Path(decision.run_dir))
    watch = TrainingWatch([str(run_dir.progress(0))], opts.stall_timeout_s,
                          busy_s=opts.busy_timeout_s)
    log_path = run_dir.solo_stderr_log()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = (sys.executable, "-u", "-m", "resilient_strategy.run.worker", "--supervisor",
            str(os.getpid()), str(run_dir.decision), opts.script, *opts.script_args)
    stall: Stall | None = None
    stall_at = float("inf")  # wall time of the stall, as the error record's
    with _signals_as_exception():
        proc = start_supervised(argv, env.snapshot(), os.getcwd(), subprocess.PIPE)
        tee = _Tee(proc.stderr, log_path)
        try:
            while proc.poll() is None:
                stall = watch.poll({0: proc.pid})
                if stall is not None:
                    stall_at = time.time()
                    with contextlib.suppress(Exception):  # evidence before the kill
                        dump_stacks({0: proc.pid}, run_dir.root)
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=poll_s)
        finally:
            with contextlib.suppress(Exception):  # a stopped process would hold a SIGTERM
                stop_stopped({0: proc.pid})
            stop_groups([proc], grace_s)
            tee.join(grace_s)
    err = _read_json(run_dir.error(0))
    if stall is not None and raised_before([err], stall_at):
        stall = None  # it raised and had not exited yet: its error is the story, not a stall
    # an error written after the stop is what the stop did to it (a SIGTERM handler that
    # raises): the stall stays the story, as on torch's path
    code = proc.returncode if proc.returncode is not None else -int(signal.SIGKILL)
    if stall is not None or (code == 0 and err is None):
        return classify_attempt(stall, [])
    return classify_attempt(None, [RankExit(
        rank=0, exitcode=code if code != 0 else 1, error=err,
        record=read_record(str(run_dir.progress(0))),
        stderr_tail=_stderr_tail(run_dir, 0))])


class _Tee:
    """The worker's stderr to this process's stderr and to a file, as it comes."""

    def __init__(self, source: IO[bytes] | None, path: Path) -> None:
        self._source = source
        self._path = path
        self._thread = threading.Thread(target=self._copy, name="rs-stderr-tee", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        if self._source is None:
            return
        out = getattr(sys.stderr, "buffer", None)
        with open(self._path, "wb") as log, self._source:
            fd = self._source.fileno()
            while chunk := os.read(fd, 65536):
                log.write(chunk)
                log.flush()
                with contextlib.suppress(OSError, ValueError):
                    if out is not None:
                        out.write(chunk)
                        out.flush()
                    else:
                        sys.stderr.write(chunk.decode("utf-8", "replace"))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


@contextlib.contextmanager
def _signals_as_exception() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise `SignalException` while the worker runs (main
    thread only), so that ``finally`` stops it first; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise SignalException(signum)

    before = {}
    for name in _SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            before[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
