"""What proving a TensorFlow multi-worker job costs, on two workers simulated on this host.

    python benchmarks/bench_tf_multiworker.py [--repeat 1] [--timeout 45] [--hang-timeout 10]

Starts, for real, two processes with a TF_CONFIG naming two free 127.0.0.1 ports (CPU workers:
MultiWorkerMirroredStrategy + RING over gRPC on loopback), next to one TF process alone, and
prints per run: the decision, the time to decide on each worker, the probe's own time, and the
bus bandwidth it measured (the figure both workers agreed on). The AUTO row injects a wrong
value into worker 1's RING probe (``wrong:1:mw_ring``): RING fails on both, AUTO is proven next.
The hang row injects RESILIENT_STRATEGY_PROBE_FAULT=hang:1 (every probe of worker 1 hangs: RING,
then AUTO): the time until both workers agree on worker 0 alone. Loopback is not a network: the bandwidth says what the probe measures, not what a real
fabric gives (no multi-host hardware was available).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = '''
import json, sys
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="tensorflow", global_batch_size=64)
with open(sys.argv[1], "w") as f:
    json.dump(sel.to_dict(), f)
'''
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(workers: int, timeout_s: float, fault: str = "") -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RESILIENT_STRATEGY_") and k != "TF_CONFIG"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
               RESILIENT_STRATEGY_TIMEOUT=str(timeout_s), RESILIENT_STRATEGY_CACHE="0",
               TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
    if fault:
        env["RESILIENT_STRATEGY_PROBE_FAULT"] = fault
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
    with tempfile.TemporaryDirectory(prefix="rs-bench-tfmw-") as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        t0 = time.perf_counter()
        procs = []
        for i in range(workers):
            wenv = dict(env)
            if workers > 1:
                wenv["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                                "task": {"type": "worker", "index": i}})
            procs.append(subprocess.Popen(
                [sys.executable, str(job), str(Path(tmp) / f"decision-{i}.json")], env=wenv,
                cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        codes = [p.wait(timeout=300) for p in procs]
        wall = time.perf_counter() - t0
        decisions = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("decision-*.json"))]
    if codes != [0] * workers or len(decisions) != workers:
        raise SystemExit(f"launch failed: exit codes {codes}")
    probes = decisions[0]["probes"]  # the chosen candidate's probe, else the last one run
    chosen = f"tensorflow:{decisions[0]['backend']}:cpu"
    probe = probes.get(chosen) or (list(probes.values())[-1] if probes else {})
    return {
        "choice": decisions[0]["label"], "same": len({d["label"] for d in decisions}) == 1,
        "decided": [d["decided_in_s"] for d in decisions], "probe_s": probe.get("elapsed_s"),
        "bus": probe.get("bus_bandwidth_gbps"), "status": probe.get("status", "no"),
        "wall": wall, "probes": len(probes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=45.0, help="probe timeout (s)")
    ap.add_argument("--hang-timeout", type=float, default=10.0,
                    help="probe timeout (s) of the run where the probe hangs")
    args = ap.parse_args()
    rows = [
        ("1 TF process, no TF_CONFIG (nothing to probe on CPU)", 1, "", args.timeout),
        ("2 TF_CONFIG workers (RING probed across both)", 2, "", args.timeout),
        ("2 workers, RING fails (wrong value on worker 1), AUTO probed next", 2,
         "wrong:1:mw_ring", args.timeout),
        (f"2 workers, RING and AUTO hang on worker 1 (timeout {args.hang_timeout:g} s)", 2,
         "hang:1", args.hang_timeout),
    ]
    print("| run | decision | same on every worker | probes | decided in (s, per worker) | "
          "probe (s) | bus GB/s | wall (s) |\n|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for name, workers, fault, timeout in rows:
        runs = [launch(workers, timeout, fault) for _ in range(args.repeat)]
        decided = [med(r["decided"][i] for r in runs) for i in range(workers)]
        probe = [r["probe_s"] for r in runs if r["probe_s"] is not None]
        bus = [r["bus"] for r in runs if r["bus"]]
        print(f"| {name} | {runs[0]['choice']} ({runs[0]['status']} probe) | "
              f"{all(r['same'] for r in runs)} | {runs[0]['probes']} | {', '.join(f'{d:.2f}' for d in decided)} | "
              f"{f'{med(probe):.2f}' if probe else '-'} | {f'{med(bus):.3f}' if bus else '-'} | "
              f"{med(r['wall'] for r in runs):.1f} |")


if __name__ == "__main__":
    main()
