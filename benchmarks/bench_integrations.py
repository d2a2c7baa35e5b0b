"""The three PyTorch examples (own loop, Lightning, Accelerate) under torchrun, healthy and with
the collective probe broken on purpose: wall time of the whole job, the decision and its time.

    python benchmarks/bench_integrations.py [--nproc 2] [--samples 8192] [--epochs 2]

Each job is a fresh ``torchrun`` with a fresh decision cache (a cold probe). Prints a markdown
table. The tools whose extra is not installed are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = (("own loop", "torch_train.py", None), ("Lightning", "lightning_train.py", "lightning"),
            ("Accelerate", "accelerate_train.py", "accelerate"))


def run(script: str, nproc: int, samples: int, epochs: int, fault: str | None) -> tuple[float, str, str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    with tempfile.TemporaryDirectory(prefix="rs-bench-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
        env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
                   RESILIENT_STRATEGY_CACHE_DIR=cache, RESILIENT_STRATEGY_QUIET="1")
        if fault:
            env["RESILIENT_STRATEGY_PROBE_FAULT"] = fault
        t0 = time.perf_counter()
        out = subprocess.run(
            [torchrun, "--nproc_per_node", str(nproc), f"examples/{script}", "--epochs",
             str(epochs), "--samples", str(samples)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        return wall, f"FAILED (exit {out.returncode})", "-"
    chose = re.search(r"chose: (.+?)\.\n", out.stdout)
    took = re.search(r"decided in ([0-9.]+) s", out.stdout)
    return wall, chose.group(1) if chose else "?", took.group(1) + " s" if took else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    print(f"| job (torchrun --nproc_per_node {args.nproc}, {args.samples} samples x "
          f"{args.epochs} epochs) | probe | decision | decided in | wall |")
    print("|---|---|---|---|---|")
    for name, script, extra in EXAMPLES:
        if extra and importlib.util.find_spec(extra) is None:
            print(f"| {name} | - | skipped: {extra} is not installed | - | - |")
            continue
        for fault in (None, "exit:1"):
            wall, chose, took = run(script, args.nproc, args.samples, args.epochs, fault)
            probe = "healthy" if fault is None else f"fault {fault}"
            print(f"| {name} | {probe} | {chose} | {took} | {wall:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
