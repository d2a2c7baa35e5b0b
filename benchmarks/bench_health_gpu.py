"""The GPU health check on a real GPU (issue 21 item 4): a fresh interpreter vs one forked from the
probes' warm fork server, after a real NCCL probe on GPU 0 was hung in collective 1 and killed.

    python benchmarks/bench_health_gpu.py [--gpus 0]

Prints a markdown table: each check's seconds and what it found (an empty list: every GPU works).
Needs CUDA GPUs; the kit's figure for the same check is printed next to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.probing import cost, health
from resilient_strategy.probing.prober import DeferredHealthProber, run_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="0", help="the GPUs to probe and check (default 0)")
    args = ap.parse_args()
    gpus = tuple(int(g) for g in args.gpus.split(","))
    env = dict(os.environ)
    rows = []
    t = time.perf_counter()
    found = health.run_check("torch", gpus, env)
    rows.append(("fresh interpreter (import torch, init each GPU, checked kernel)",
                 time.perf_counter() - t, found,
                 cost.health_check_seconds("torch", len(gpus))))
    spec = ProbeSpec("torch:nccl:" + args.gpus, "torch", "nccl", gpus, world_size=len(gpus),
                     timeout_s=60.0)
    hung = {**env, "RESILIENT_STRATEGY_PROBE_FAULT": "hang_collective:0:nccl"}
    t = time.perf_counter()
    res = run_probe(spec, hung, health_check=False)
    rows.append((f"NCCL probe hung in collective 1, killed: {res.status} "
                 f"{dict(res.extra).get('hang', '')}", time.perf_counter() - t, None,
                 cost.probe_seconds(spec, "collective", forked=True)))
    prober = DeferredHealthProber()
    t = time.perf_counter()
    found = prober.check_gpus("torch", gpus, env)
    rows.append(("forked here where fit, else fresh (the deferred check)",
                 time.perf_counter() - t, found, prober.check_seconds("torch", len(gpus), env)))
    print(f"\nGPUs {args.gpus}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print("| health check | seconds | broken GPUs | the kit's figure |\n|---|---|---|---|")
    for what, s, found_, kit in rows:
        print(f"| {what} | {s:.2f} | {'' if found_ is None else found_} | {kit:.2f} |")


if __name__ == "__main__":
    main()
