"""Every TensorFlow cross-device op, verified for every replica count it can be chosen for.

    python benchmarks/verify_tf_cross_device.py [--max-replicas 8] [--ops hierarchical_copy,...]

Runs the real TensorFlow probe (``probes/tf_worker``: replica-context all-reduces checked
exactly at 4 KiB..25 MiB over several iterations, then a Keras ``fit`` step whose replicas must
agree) on 1..N logical CPU devices for HierarchicalCopyAllReduce, ReductionToOneDevice and
NcclAllReduce, and prints a markdown table. A strategy that gives a wrong value for some count
must become a rule in ``known_issues.toml`` (with this table as its source) so it is never
chosen there; NCCL has no CPU kernel, so on a machine without GPUs it fails at every count with
``backend_unavailable``, which says nothing about its sums.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.probing.prober import run_probe

OPS = ("hierarchical_copy", "reduction_to_one_device", "nccl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-replicas", type=int, default=8)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
    rows = []
    wrong = []
    t0 = time.perf_counter()
    for op in args.ops.split(","):
        for n in range(1, args.max_replicas + 1):
            spec = ProbeSpec(f"tensorflow:{op}:x{n}", "tensorflow", op, (), logical_cpus=n,
                             timeout_s=args.timeout, message_bytes=4 << 20)
            res = run_probe(spec, env)
            rows.append((op, n, res.status, res.cause or "exact", f"{res.elapsed_s:.1f} s",
                         res.detail[:110]))
            if res.cause in ("wrong_result", "nan_result", "zero_result"):
                wrong.append((op, n, res.detail))
            print(f"{op} x{n}: {res.status} {res.cause} {res.elapsed_s:.1f}s", file=sys.stderr)
    import importlib.metadata as md

    try:
        tf = md.version("tensorflow")
    except md.PackageNotFoundError:
        tf = md.version("tensorflow-cpu")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nTensorFlow {tf}, {os.cpu_count()} CPUs (load average {load:.1f}), logical CPU "
          f"devices, {time.perf_counter() - t0:.0f} s in all")
    print("| op | replicas | status | values | probe time | detail |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print("\nwrong values: " + ("; ".join(f"{op} x{n}: {d}" for op, n, d in wrong)
                                if wrong else "none"))


if __name__ == "__main__":
    main()
