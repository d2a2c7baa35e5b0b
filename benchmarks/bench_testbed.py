"""Real faults on the multi-node test bed (tests/testbed.py), one row per fault.

    sudo python benchmarks/bench_testbed.py [--faults sigkill,sigstop,...] [--markdown]

Two nodes as network namespaces on a bridge (198.18.0.0/24), `resilient-strategy run --nnodes 2
--nproc-per-node 1` in each (CPU, gloo, examples/torch_train.py: 48 optimizer steps of a 1024-wide
MLP, a checkpoint every 4, --stall-timeout 5), and one fault struck from outside the job once rank
0 has done step 8 (`blackhole`: a blackhole route to the master on node 1 before the job starts,
--probe-timeout 10; its times are from the start of the job). Columns (seconds from the fault,
measured from outside by watching the files the supervisors write and their processes):

- stopped: node 0's workers of the faulted attempt are gone (the supervisor judged and stopped);
- verdict (cause): the cause node 0 recorded for the failed candidate in its next decision
  (a run that failed before its first attempt: each node's `setup` record in attempts.json,
  the error, how, and the node that went silent);
- action: what the next launch attempt ran on (none: not relaunched);
- relaunch decided: the next attempt's decision written on node 0;
- training again: the first optimizer step of the next attempt;
- steps: the optimizer-step count of the last checkpoint over the uninterrupted count;
- ended: each node's supervisor exited (node 0, node 1);
- leftovers: processes of the job alive after both supervisors ended (or were killed at the
  bed's limit; the bed's sweep removes them after).

`--membership none,lost_node,cut_off_start,rejoin` runs the scenarios of nodes that come and go
instead (three nodes; `cut_off_start` two; tests/testbed.py `run_membership`): one row each,
with the nodes whose rank 0 trained in each attempt, and node 0's membership records.

Needs root and `ip`; prints why not otherwise.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import testbed as tb  # noqa: E402

ORDER = ("sigkill", "sigstop", "link_down", "bridge_down", "straggler", "decoy", "blackhole")
LIMITS = {"link_down": 150.0}  # node 0 waits for node 1 at the relaunch, then goes on alone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(ORDER))
    ap.add_argument("--membership", default="",
                    help="instead: nodes that come and go, e.g. none,lost_node,cut_off_start,"
                         "rejoin (three nodes; cut_off_start: two)")
    ap.add_argument("--prefix", default=tb.PREFIX,
                    help="the bed's names (namespaces, links): another prefix for a bed beside "
                         "one already running (the suite's test bed uses the default)")
    args = ap.parse_args()
    why = tb.unavailable()
    if why is not None:
        print(f"the test bed cannot run here: {why}")
        return 2
    if args.membership:
        return membership(args.membership.split(","), args.prefix)
    import torch

    print(f"# Test bed: real faults, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print(f"{platform.node()}: Linux {platform.release()}, {_cores()} cores, Python "
          f"{platform.python_version()}, torch {torch.__version__}; 2 nodes x 1 process, "
          f"--stall-timeout {tb.STALL_S:g}, fault at step {tb.FAULT_STEP} of "
          f"{tb.EXPECTED_STEPS}.\n")
    rows = []
    for fault in args.faults.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-testbed-") as work:
            t = time.monotonic()
            with tb.testbed() as bed:
                o = tb.run_fault(bed, Path(work), fault, limit_s=LIMITS.get(fault, 240.0))
            left_ns = tb.namespaces()
            row = o.row()
            row["run s"] = f"{time.monotonic() - t:.0f}"
            row["namespaces left"] = len(left_ns)
            rows.append(row)
            print(f"<!-- {fault}: {o} -->", flush=True)
    heads = list(rows[0])
    print()
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join(str(r[h]) for h in heads) + " |")
    return 0


def membership(faults: list[str], prefix: str = tb.PREFIX) -> int:
    """One row per membership scenario (tests/testbed.py ``run_membership``): each node's exit
    status, the nodes whose rank 0 trained in each attempt, seconds from the fault to training
    again and to each supervisor's exit, the optimizer steps against the uninterrupted count,
    and node 0's membership records."""
    import json

    rows = []
    for fault in faults:
        nodes = 2 if fault == "cut_off_start" else 3
        with tempfile.TemporaryDirectory(prefix="bench-member-") as work:
            t = time.monotonic()
            with tb.testbed(nodes, prefix) as bed:
                o = tb.run_membership(bed, Path(work), fault, limit_s=240.0)
            row = o.row()
            row["run s"] = f"{time.monotonic() - t:.0f}"
            rows.append(row)
            print(f"<!-- {fault}: membership {json.dumps(o.membership(0))} -->", flush=True)
            print(f"<!-- {fault}: {o} -->", flush=True)
            for i in range(nodes):
                log = Path(work) / f"node{i}" / "supervisor.log"
                lines = [ln for ln in log.read_text(errors="replace").splitlines()
                         if ln.startswith("resilient-strategy run:")] if log.exists() else []
                print(f"<!-- node {i}:\n" + "\n".join(lines[-8:]) + "\n-->", flush=True)
    heads = list(rows[0])
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join(str(r[h]) for h in heads) + " |")
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
