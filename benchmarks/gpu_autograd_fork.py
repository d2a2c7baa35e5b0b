"""On a GPU host: a backward pass before the decision starts autograd's device threads; the
probe's workers must then not be forked from this process (forkserver.autograd_threads), and
gloo on 2 CPU processes is proven, not failed ("Unable to handle autograd's threading in
combination with fork-based multiprocessing"). Prints the thread names and the decision.

    python benchmarks/gpu_autograd_fork.py [--before]   (a CUDA build of torch, a GPU visible)

The backward runs with the GPUs visible; the probe then asks for CPU processes
(``CUDA_VISIBLE_DEVICES=""``, as a test does). ``--before``: the autograd check switched off
(the code before it), to show the failure it prevents.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    import torch

    x = torch.ones(2, requires_grad=True)
    x.sum().backward()  # CPU tensors: on a CUDA build this starts the device threads
    names = sorted({Path(f"/proc/self/task/{t}/comm").read_text().strip()
                    for t in os.listdir("/proc/self/task")})
    from resilient_strategy.probing import forkserver

    if "--before" in sys.argv:
        forkserver.autograd_threads = lambda tasks="": ""  # type: ignore[assignment]
    why = forkserver.why_not_here()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["RESILIENT_STRATEGY_CACHE_DIR"] = cache
        import contextlib
        import io

        from resilient_strategy.cli import main as cli

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli(["probe", "--framework", "torch", "--nproc-per-node", "2", "--json"])
    decision = json.loads(out.getvalue())["decisions"]["torch"]
    print(json.dumps({"threads": names, "why_not_here": why, "rc": rc,
                      "backend": decision["backend"],
                      "world": decision.get("launch_world_size")}))
    return 0 if decision["backend"] == "gloo" else 1


if __name__ == "__main__":
    sys.exit(main())
