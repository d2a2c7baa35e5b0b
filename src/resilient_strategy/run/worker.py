"""A worker of ``resilient-strategy run``: ``python -m resilient_strategy.run.worker --supervisor
PID DECISION SCRIPT [ARGS...]`` runs SCRIPT as ``python SCRIPT ARGS`` would, with the
supervisor's decision handed to ``resilient_strategy()`` (see
`resilient_strategy.records.handoff`).

Around the script it:

- dies with its supervisor, however the supervisor dies (``PR_SET_PDEATHSIG`` on Linux, a
  watchdog thread elsewhere: `resilient_strategy.probing.workers.watchdog`), so that a
  SIGKILLed ``run`` leaves no worker training;
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

import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import IO  # noqa: E402

from ..errors import NoSpaceError  # noqa: E402
from ..frameworks.teardown import process_group_error, skip_exit_barrier  # noqa: E402
from ..probing.workers.watchdog import watch_parent  # noqa: E402
from ..records import phases  # noqa: E402
from ..records.flight import serve  # noqa: E402
from ..records.handoff import DECISION_VAR, bound_env, current_reporter, write_error  # noqa: E402
from ..records.rundir import RunDir  # noqa: E402

_USAGE = "usage: python -m resilient_strategy.run.worker --supervisor PID DECISION SCRIPT [ARGS...]"
#: Process-wide by nature: the stacks file stays open for faulthandler as long as the process.
_KEEP: list[IO[str]] = []


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[0] != "--supervisor" or not args[1].isdigit():
        raise SystemExit(_USAGE)
    watch_parent(int(args[1]))  # before anything slow: the supervisor may already be gone
    decision, script, rest = args[2], args[3], args[4:]
    os.environ[DECISION_VAR] = decision  # private to this run; read by resilient_strategy()
    os.environ.update(bound_env(os.environ))  # the GPUs a decision over a subset is bound to
    run_dir = Path(decision).parent
    where = RunDir(run_dir)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    phases.mark(where.phases(local_rank), phases.WORKER_STARTED, _STARTED)
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
