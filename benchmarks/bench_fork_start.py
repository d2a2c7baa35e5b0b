"""How a probe worker's start costs a cold decision: forked from the deciding process where it is
fit, and where it is not (a second Python thread runs in it), against fresh interpreters.

    python benchmarks/bench_fork_start.py [--repeat 6]

The bench process imports torch first (a training script has), then decides (gloo on 2 CPU
processes, ``probe="force"``, an empty cache) in three ways, alternating (load drifts on a
shared host):

- ``here``: nothing else runs in the process: the workers are forked from it (`fork_here`);
- ``unfit``: a second Python thread waits in the process, so forking here is refused; what
  starts the workers then is this checkout's (fresh interpreters since 2026-12-02; before, a
  fork server that imported torch once: run this script at commit cd5e3e1 for that figure);
- ``off``: the same thread, ``RESILIENT_STRATEGY_FORKSERVER=0``: fresh interpreters.

Prints each run, then the medians and the median of the paired differences ``off - unfit``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed

import resilient_strategy

MODES = ("here", "unfit", "off")
LAUNCH = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "0"}


def decide_once(mode: str, env: dict[str, str]) -> tuple[float, str]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait) if mode != "here" else None
    if thread is not None:
        thread.start()
    run_env = {**env, **({"RESILIENT_STRATEGY_FORKSERVER": "0"} if mode == "off" else {})}
    try:
        with tempfile.TemporaryDirectory() as cache:
            t = time.perf_counter()
            sel = resilient_strategy.resilient_strategy(
                framework="torch", global_batch_size=128, timeout=60, cache_dir=cache,
                probe="force", env=run_env)
            return time.perf_counter() - t, sel.candidate.label
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args()
    env = {k: v for k, v in {**os.environ, **LAUNCH}.items()
           if k not in ("RESILIENT_STRATEGY_PROBE_FAULT", "RESILIENT_STRATEGY_FORKSERVER")}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeat):
        for mode in MODES:
            dt, label = decide_once(mode, env)
            times[mode].append(dt)
            print(f"{r} {mode} {dt:.2f} s ({label}; load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\n{os.cpu_count()} CPUs, python {sys.version.split()[0]}, torch {torch.__version__}")
    print("| way | median (s) | runs (s) |\n|---|---|---|")
    for mode in MODES:
        print(f"| {mode} | {statistics.median(times[mode]):.2f} | "
              + ", ".join(f"{x:.2f}" for x in times[mode]) + " |")
    paired = [b - a for a, b in zip(times["unfit"], times["off"], strict=True)]
    print(f"| off - unfit, paired | {statistics.median(paired):.2f} | "
          + ", ".join(f"{x:+.2f}" for x in paired) + " |")


if __name__ == "__main__":
    main()
