"""What proving the links between nodes costs, on two nodes simulated on this host.

    python benchmarks/bench_multinode.py [--repeat 1] [--timeout 30] [--hang-timeout 10]

Launches, for real, `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` twice on
127.0.0.1 (gloo between the "nodes" over loopback), next to one node with 2 processes, and prints
per run: the decision, the time to decide on each node, the probe's own time, and the bus
bandwidth it measured. The hang row injects RESILIENT_STRATEGY_PROBE_FAULT=hang:1:gloo: the time
until both nodes agree on node 0 alone. Loopback is not a network: the bandwidth says what the
probe measures, not what a real fabric gives (no multi-node hardware was available).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = '''
import json, os, sys
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64,
                                            gradient_bytes=40_000, sample_seconds=0.001)
with open(os.path.join(sys.argv[1], f"decision-{os.environ['RANK']}.json"), "w") as f:
    json.dump(sel.to_dict(), f)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(nodes: int, per_node: int, timeout_s: float, fault: str = "") -> dict[str, Any]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}  # the caller's, as given
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
               RESILIENT_STRATEGY_TIMEOUT=str(timeout_s), RESILIENT_STRATEGY_CACHE="0",
               OMP_NUM_THREADS="1")
    if fault:
        env["RESILIENT_STRATEGY_PROBE_FAULT"] = fault
    with tempfile.TemporaryDirectory(prefix="rs-bench-mn-") as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        port = free_port()
        argv = [torchrun, "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", uuid.uuid4().hex[:8], str(job), tmp]
        t0 = time.perf_counter()
        procs = [subprocess.Popen(argv, env=env, cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for _ in range(nodes)]
        codes = [p.wait(timeout=300) for p in procs]
        wall = time.perf_counter() - t0
        decisions = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("decision-*.json"))]
    if codes != [0] * nodes or not decisions:
        raise SystemExit(f"launch failed: exit codes {codes}")
    probe = decisions[0]["probes"].get("torch:gloo:cpu", {})
    return {
        "choice": decisions[0]["label"], "same": len({d["label"] for d in decisions}) == 1,
        "decided": [d["decided_in_s"] for d in decisions], "probe_s": probe.get("elapsed_s"),
        "bus": probe.get("bus_bandwidth_gbps"), "status": probe.get("status"), "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0, help="probe timeout (s)")
    ap.add_argument("--hang-timeout", type=float, default=10.0,
                    help="probe timeout (s) of the run where the probe hangs")
    args = ap.parse_args()
    rows = [
        ("1 node x 2 processes (gloo probe on one node)", 1, 2, "", args.timeout),
        ("2 nodes x 1 process (gloo probed across nodes)", 2, 1, "", args.timeout),
        (f"2 nodes, gloo hangs on node 1 (timeout {args.hang_timeout:g} s)", 2, 1,
         "hang:1:gloo", args.hang_timeout),
    ]
    print("| run | decision | same on every node | decided in (s, per rank) | probe (s) | "
          "bus GB/s | launch wall (s) |\n|---|---|---|---|---|---|---|")
    for name, nodes, per, fault, timeout in rows:
        runs = [launch(nodes, per, timeout, fault) for _ in range(args.repeat)]
        med = statistics.median
        decided = [med(r["decided"][i] for r in runs) for i in range(len(runs[0]["decided"]))]
        probe = [r["probe_s"] for r in runs if r["probe_s"] is not None]
        bus = [r["bus"] for r in runs if r["bus"]]
        print(f"| {name} | {runs[0]['choice']} ({runs[0]['status']} probe) | "
              f"{all(r['same'] for r in runs)} | {', '.join(f'{d:.2f}' for d in decided)} | "
              f"{med(probe):.2f} | {f'{med(bus):.3f}' if bus else '-'} | "
              f"{med(r['wall'] for r in runs):.1f} |")


if __name__ == "__main__":
    main()
