"""A worker of ``resilient-strategy run``: ``python -m resilient_strategy.run.worker --supervisor
PID DECISION SCRIPT [ARGS...]`` runs SCRIPT as ``python SCRIPT ARGS`` would, with the
supervisor's decision handed to ``resilient_strategy()`` (see
`resilient_strategy.records.handoff`). Under a warm start the same worker is a function,
`warm_main`, called in a child forked from the fork server (`resilient_strategy.run.warm`).

Around the script it:

- dies with its supervisor, however the supervisor dies (``PR_SET_PDEATHSIG`` on Linux, a
  watchdog thread elsewhere: `resilient_strategy.probing.workers.watchdog`), so that a
  SIGKILLed ``run`` leaves no worker training;
- says which process it is in ``rank<N>.pid`` (`resilient_strategy.records.handoff.write_pid`);
- writes its Python stacks to ``rank<N>.stacks.txt`` on SIGUSR1 (faulthandler), which the
  supervisor sends before it stops a stalled group;
- answers the supervisor's request for torch's flight-recorder dump from a daemon thread (the
  main thread may be blocked inside a collective): `resilient_strategy.records.flight.serve`;
- on an exception, leaves its full traceback in ``rank<N>.traceback.txt``, one line on stderr
  instead of the traceback, then its error record (the exception's class chain and the frames it
  was raised through) for the supervisor's classification, before any barrier or teardown: the
  supervisor acts on the record as soon as it sees it, and the exit skips the process group's
  exit barrier (`resilient_strategy.frameworks.teardown.skip_exit_barrier`).
"""

from __future__ import annotations

import time

_STARTED = time.time()  # the worker's own code begins: the interpreter is up

import contextlib  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import IO  # noqa: E402

from ..errors import NoSpaceError  # noqa: E402
from ..frameworks.teardown import process_group_error, skip_exit_barrier  # noqa: E402
from ..probing.workers.watchdog import watch_parent, watch_process  # noqa: E402
from ..process import PROCESS  # noqa: E402
from ..records import phases  # noqa: E402
from ..records.flight import serve  # noqa: E402
from ..records.handoff import (  # noqa: E402
    DECISION_VAR,
    bound_env,
    current_reporter,
    write_error,
    write_pid,
)
from ..records.rundir import RunDir  # noqa: E402

_USAGE = "usage: python -m resilient_strategy.run.worker --supervisor PID DECISION SCRIPT [ARGS...]"
#: Process-wide by nature: the stacks file stays open for faulthandler as long as the process.
_KEEP: list[IO[str]] = PROCESS.hold(
    "run.worker.keep", list, "the stacks file, open for faulthandler as long as the process")


def main(argv: Sequence[str] | None = None) -> None:
    args = _checked(list(sys.argv[1:] if argv is None else argv))
    watch_parent(int(args[1]))  # before anything slow: the supervisor may already be gone
    _run(args, _STARTED)


def warm_main(environment: Mapping[str, str], *argv: str) -> None:
    """The worker as a function, for a warm start (`resilient_strategy.run.warm`): torch's
    elastic agent calls it in a child forked from the fork server, with the supervisor's
    environment at the attempt's launch (``environment``) and the arguments `main` takes.
    It behaves as `main` in a fresh interpreter: the environment made exactly a fresh
    worker's first (`resilient_strategy.run.warm.worker_environment`), death with the server
    and with the supervisor, stdout and stderr unbuffered (``python -u``), the worker's
    phases marked from this call, the script's exit code (a ``SystemExit`` other than 0 is
    raised on; 0 returns, so that the agent gets its return value), and the ``atexit`` hooks
    run before the function returns (multiprocessing's child ends with ``os._exit``)."""
    started = time.time()
    from . import warm

    wanted = warm.worker_environment(environment, warm.SERVER_ENV, os.environ)
    os.environ.clear()
    os.environ.update(wanted)
    warm.match_threads(os.environ, warm.SERVER_ENV)
    _as_a_fresh_process()
    args = _checked(list(argv))
    watch_parent(os.getppid())  # the fork server: it ends with the supervisor
    watch_process(int(args[1]))  # and the supervisor itself
    _unbuffered()
    if warm.cuda_started():
        raise SystemExit("resilient-strategy run: the warm start's fork server initialized "
                         "CUDA; start without --warm-start")
    try:
        _run(args, started)
    except SystemExit as exc:
        _at_exit()
        if exc.code in (None, 0):
            return
        raise
    except KeyboardInterrupt:
        _at_exit()
        import signal  # die of it, as the interpreter does (multiprocessing would exit 0)

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException:
        _at_exit()
        raise
    _at_exit()


def _as_a_fresh_process() -> None:
    """What a cold worker is that a child of multiprocessing's fork server is not: the leader
    of a session of its own (torch starts a cold worker with ``start_new_session``), so that
    everything the script starts (DataLoader workers, their fork server, anything it forked)
    is found by its session and stopped with the attempt (`run.agent.sweep_attempt`); and
    multiprocessing's start method this Python's default again (the server's ``forkserver``
    otherwise: a DataLoader with workers in a script without a ``__main__`` guard died at its
    first batch, "exited unexpectedly", leaving two fork servers, a resource tracker and 28
    semaphores in /dev/shm behind the run)."""
    import multiprocessing

    with contextlib.suppress(OSError):  # already a leader: nothing to do
        os.setsid()
    with contextlib.suppress(RuntimeError, ValueError):
        multiprocessing.set_start_method(None, force=True)
    with contextlib.suppress(AttributeError):  # set by the server's bootstrap of this child
        del multiprocessing.current_process()._inheriting  # type: ignore[attr-defined]


def _checked(args: list[str]) -> list[str]:
    if len(args) < 4 or args[0] != "--supervisor" or not args[1].isdigit():
        raise SystemExit(_USAGE)
    return args


def _run(args: Sequence[str], started: float) -> None:
    decision, script, rest = args[2], args[3], list(args[4:])
    os.environ[DECISION_VAR] = decision  # private to this run; read by resilient_strategy()
    os.environ.update(bound_env(os.environ))  # the GPUs a decision over a subset is bound to
    run_dir = Path(decision).parent
    where = RunDir(run_dir)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    phases.mark(where.phases(local_rank), phases.WORKER_STARTED, started)
    write_pid(where, local_rank, int(os.environ.get("RANK", local_rank)))
    _stacks_on_signal(where.stacks(local_rank))
    serve(run_dir, local_rank, int(os.environ.get("RANK", local_rank)))
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _raised(run_dir, local_rank, exc)
        elif (reporter := current_reporter()) is not None:
            reporter.done()  # sys.exit(0) ends the script as returning does: it finished
        raise
    except Exception as exc:
        kept_at = where.traceback(local_rank)
        kept = True
        try:  # the traceback first: the error record is the word the supervisor acts on
            kept_at.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
        except OSError as write_exc:
            if NoSpaceError.from_os_error(write_exc, str(kept_at), "the traceback") is None:
                _raised(run_dir, local_rank, exc)
                raise exc from None  # nowhere to keep it: the traceback goes to stderr as usual
            kept = False  # a full disk: the one line below, no traceback to keep anywhere
        text = " ".join(str(exc).split())
        with contextlib.suppress(OSError):  # stderr may be a file on the full disk itself
            print(f"resilient-strategy run: rank {os.environ.get('RANK', local_rank)}: "
                  f"{type(exc).__name__}: {text[:300]}"
                  + (" (the traceback goes to the evidence file)" if kept else ""),
                  file=sys.stderr, flush=True)
        _raised(run_dir, local_rank, exc)
        sys.exit(1)
    except BaseException as exc:
        _raised(run_dir, local_rank, exc)
        raise
    reporter = current_reporter()
    if reporter is not None:
        reporter.done()


def _at_exit() -> None:
    """What the interpreter runs at exit: the ``atexit`` hooks (the process group's end among
    them), then the streams flushed."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _unbuffered() -> None:
    """stdout and stderr as ``python -u`` makes them: unbuffered, written through."""
    import io

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            stream.flush()
            fd = stream.fileno()
            raw = io.FileIO(fd, "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(
                raw, encoding=stream.encoding, errors=stream.errors, write_through=True))
        except (AttributeError, OSError, ValueError):
            continue


def _raised(run_dir: Path, local_rank: int, exc: BaseException) -> None:
    """The script raised: its error record now, before any barrier or teardown (the supervisor
    acts on it at once), and no exit barrier after it (the peers may never come)."""
    write_error(run_dir, local_rank, exc, current_reporter(), process_group_error())
    skip_exit_barrier()


def _stacks_on_signal(path: Path) -> None:
    import faulthandler
    import signal

    sig = getattr(signal, "SIGUSR1", None)
    if sig is None:
        return
    try:
        fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open while the process lives
    except OSError:
        return
    _KEEP.append(fh)
    faulthandler.register(sig, file=fh, all_threads=True, chain=False)


if __name__ == "__main__":
    main()
