"""A worker of ``resilient-strategy run``: ``python -m resilient_strategy.run.worker DECISION SCRIPT
[ARGS...]`` runs SCRIPT as ``python SCRIPT ARGS`` would, with the supervisor's decision handed to
``resilient_strategy()`` (see :mod:`resilient_strategy.records.handoff`), and leaves an error record for
the supervisor when the script fails."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from ..records.handoff import DECISION_VAR, current_reporter, write_error


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        raise SystemExit("usage: python -m resilient_strategy.run.worker DECISION SCRIPT [ARGS...]")
    decision, script, rest = args[0], args[1], args[2:]
    os.environ[DECISION_VAR] = decision  # private to this run; read by resilient_strategy()
    run_dir = str(Path(decision).parent)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_error(run_dir, local_rank, exc, current_reporter())
        raise
    except BaseException as exc:
        write_error(run_dir, local_rank, exc, current_reporter())
        raise
    reporter = current_reporter()
    if reporter is not None:
        reporter.done()


if __name__ == "__main__":
    main()
