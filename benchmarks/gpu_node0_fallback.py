"""Issue 31 on real GPUs: a 2-node torch job whose nodes cannot talk keeps node 0's own GPUs.

Two torchrun launches on one host play the nodes (static rendezvous on 127.0.0.1, node ranks
fixed), each with its own half of the GPUs (CUDA_VISIBLE_DEVICES), ``--nproc-per-node`` GPUs
each. Only node 1's launch gets the probe fault ``hang:1`` (its process of every probe across
the nodes hangs: rank 1 of the cross-node probe group is node 1); node 0's own probes never
see it. Expected: both nodes decide ``nccl/node0`` on node 0's GPUs, num_replicas = GPUs per
node, the global batch kept (accumulation = 2), node 0's ranks train, node 1's ranks exit 0.

    python benchmarks/gpu_node0_fallback.py --gpus-per-node 2     # on a 4-GPU host

Prints one JSON object (the decisions and what trained) and exits 1 when the expectation fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "_two_node_job.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="each probe's timeout (s)")
    args = ap.parse_args()
    n = args.gpus_per_node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    out = Path(tempfile.mkdtemp(prefix="rs-node0-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")}
    base.update({"PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_TIMEOUT": str(args.timeout),
                 "RESILIENT_STRATEGY_CACHE": "0"})
    procs = []
    for node in (0, 1):
        env = {**base, "CUDA_VISIBLE_DEVICES": ",".join(str(node * n + i) for i in range(n))}
        if node == 1:
            env["RESILIENT_STRATEGY_PROBE_FAULT"] = "hang:1"
        procs.append(subprocess.Popen(
            [torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(n),
             "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port",
             str(port), "--max-restarts", "0", str(JOB), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    codes, logs = [], []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=20 * args.timeout + 120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            text, _ = p.communicate()
        codes.append(p.returncode)
        logs.append(text.decode(errors="replace")[-3000:])
    decisions = {int(f.stem.split("-")[1]): json.loads(f.read_text())
                 for f in out.glob("decision-*.json")}
    trained = {int(f.stem.split("-")[1]): json.loads(f.read_text())
               for f in out.glob("trained-*.json")}
    summary = {r: {k: d.get(k) for k in ("backend", "node_local", "devices", "num_replicas",
                                         "accumulation_steps", "active")}
               for r, d in sorted(decisions.items())}
    ok = (codes == [0, 0] and len(decisions) == 2 * n
          and all(s["backend"] == "nccl" and s["node_local"] for s in summary.values())
          and sorted(trained) == list(range(n)))
    print(json.dumps({"ok": ok, "codes": codes, "decisions": summary,
                      "trained": trained, "logs": logs if not ok else []}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
