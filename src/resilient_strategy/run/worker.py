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
  main thread may be blocked inside a collective): `serve`;
- on an exception, leaves an error record for the supervisor's classification, its full
  traceback in ``rank<N>.traceback.txt`` (the supervisor copies both into the evidence file),
  and one line on stderr instead of the traceback.
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
from ..probing.workers.watchdog import watch_parent  # noqa: E402
from ..records import phases  # noqa: E402
from ..records.flight import serve  # noqa: E402
from ..records.handoff import DECISION_VAR, bound_env, current_reporter, write_error  # noqa: E402

_USAGE = "usage: python -m resilient_strategy.run.worker --supervisor PID DECISION SCRIPT [ARGS...]"
_KEEP: list[IO[str]] = []  # the stacks file stays open for faulthandler


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[0] != "--supervisor" or not args[1].isdigit():
        raise SystemExit(_USAGE)
    watch_parent(int(args[1]))  # before anything slow: the supervisor may already be gone
    decision, script, rest = args[2], args[3], args[4:]
    os.environ[DECISION_VAR] = decision  # private to this run; read by resilient_strategy()
    os.environ.update(bound_env(os.environ))  # the GPUs a decision over a subset is bound to
    run_dir = Path(decision).parent
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    phases.mark(phases.worker_path(run_dir, local_rank), phases.WORKER_STARTED, _STARTED)
    _stacks_on_signal(run_dir / f"rank{local_rank}.stacks.txt")
    serve(run_dir, local_rank, int(os.environ.get("RANK", local_rank)))
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_error(run_dir, local_rank, exc, current_reporter())
        elif (reporter := current_reporter()) is not None:
            reporter.done()  # sys.exit(0) ends the script as returning does: it finished
        raise
    except Exception as exc:
        write_error(run_dir, local_rank, exc, current_reporter())
        where = run_dir / f"rank{local_rank}.traceback.txt"
        kept = True
        try:
            where.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
        except OSError as write_exc:
            if NoSpaceError.from_os_error(write_exc, str(where), "the traceback") is None:
                raise exc from None  # nowhere to keep it: the traceback goes to stderr as usual
            kept = False  # a full disk: the one line below, no traceback to keep anywhere
        text = " ".join(str(exc).split())
        print(f"resilient-strategy run: rank {os.environ.get('RANK', local_rank)}: "
              f"{type(exc).__name__}: {text[:300]}"
              + (" (the traceback goes to the evidence file)" if kept else ""),
              file=sys.stderr, flush=True)
        sys.exit(1)
    except BaseException as exc:
        write_error(run_dir, local_rank, exc, current_reporter())
        raise
    reporter = current_reporter()
    if reporter is not None:
        reporter.done()


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
