"""Run by tests/test_warm_start.py in a process of its own (its fork server ends with it):
``python tests/_warm_exits.py WORKDIR``. Starts a fork server as the warm start's (a shorter
preload), then starts each
of a few one-line scripts through torch's elastic ``start_processes`` as the agent does under a
warm start (the function entry point `resilient_strategy.run.worker.warm_main`, the
``forkserver`` start method), and prints one JSON line: per script, the exit code torch's
process context reports (None: it succeeded), whether the context saw the worker done, the
process's own exit code, and whether the worker left an error record."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SCRIPTS = {
    "returns": "x = 1\n",
    "exit0": "import sys\nsys.exit(0)\n",
    "exit3": "import sys\nsys.exit(3)\n",
    "raises": "raise ValueError('a bug in the script')\n",
    "os_exit0": "import os\nos._exit(0)\n",
}


def main() -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from resilient_strategy.records.rundir import RunDir
    from resilient_strategy.run import warm
    from resilient_strategy.run.worker import warm_main

    work = Path(sys.argv[1])
    # the warm start's server with less than run/warm.py's PRELOAD (the exits are the worker
    # function's; torch._dynamo is not needed), to keep the test fast
    import multiprocessing

    multiprocessing.get_context(warm.START_METHOD).set_forkserver_preload(
        ["resilient_strategy.run.warm", "resilient_strategy.run.worker",
         "torch.distributed.elastic.multiprocessing"])
    out: dict[str, object] = {}
    for name, text in SCRIPTS.items():
        run_dir = work / name
        run_dir.mkdir(parents=True)
        script = run_dir / "script.py"
        script.write_text(text)
        args = ("--supervisor", str(os.getpid()), str(run_dir / "decision.json"), str(script))
        ctx = start_processes(
            name=name, entrypoint=warm_main, args={0: (dict(os.environ), *args)},
            envs={0: {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}},
            logs_specs=DefaultLogsSpecs(log_dir=str(work / "logs" / name)),
            start_method=warm.START_METHOD)
        end = time.monotonic() + 60
        result = None
        while time.monotonic() < end:
            result = ctx.wait(0)
            if result is not None:
                break
            if name == "os_exit0" and all(p.exitcode == 0 for p in ctx._pc.processes):
                break  # torch's context waits for a return value that never comes
            time.sleep(0.02)
        exited = [p.exitcode for p in ctx._pc.processes]
        ctx.close()
        code = None
        if result is not None and result.is_failed():
            code = next(iter(result.failures.values())).exitcode
        out[name] = {"exitcode": code, "done": result is not None, "exited": exited,
                     "error_record": RunDir(run_dir).error(0).exists()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
