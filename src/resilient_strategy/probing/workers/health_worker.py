"""GPU health worker: does each GPU still initialize and run a kernel?

    python -m resilient_strategy.probing.workers.health_worker --framework torch --devices 0,1 \\
        --report PATH [--parent-pid PID]

For each device in order: record it as ``current``, initialize it, run a kernel whose result is
checked, synchronize, and record ``{"ok": true}`` or the error. The report is rewritten after
each step, so a hang leaves behind which GPU it was on (see `resilient_strategy.probing.health`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .common import error_text, write_report
from .watchdog import watch_parent

NUMEL = 1 << 20


def _torch_check(index: int) -> str:
    import torch

    if index >= torch.cuda.device_count():
        return f"torch sees {torch.cuda.device_count()} GPU(s), not GPU {index}"
    with torch.cuda.device(index):
        x = torch.ones(NUMEL, device=f"cuda:{index}")
        total = float((x * 2).sum())
        torch.cuda.synchronize(index)
    return "" if total == 2.0 * NUMEL else f"a kernel computed {total} instead of {2.0 * NUMEL}"


def _tf_check(index: int) -> str:
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if index >= len(gpus):
        return f"TensorFlow sees {len(gpus)} GPU(s), not GPU {index}"
    with tf.device(f"/gpu:{index}"):
        total = float(tf.reduce_sum(tf.ones([NUMEL]) * 2.0).numpy())
    return "" if total == 2.0 * NUMEL else f"a kernel computed {total} instead of {2.0 * NUMEL}"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m resilient_strategy.probing.workers.health_worker")
    p.add_argument("--framework", choices=["torch", "tensorflow"], required=True)
    p.add_argument("--devices", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--parent-pid", type=int, default=None)
    args = p.parse_args(argv)
    watch_parent(args.parent_pid)
    check = _torch_check if args.framework == "torch" else _tf_check
    report: dict[str, Any] = {"gpus": {}}
    code = 0
    for d in (int(x) for x in args.devices.split(",") if x.strip()):
        report["current"] = d
        write_report(args.report, report)
        try:
            problem = check(d)
        except Exception as exc:  # a CUDA error: this GPU is broken, the next may be fine
            problem = error_text(exc, frames=2)
        report["gpus"][str(d)] = {"ok": not problem, **({"error": problem} if problem else {})}
        code = code or (1 if problem else 0)
    report.pop("current", None)
    write_report(args.report, report)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
