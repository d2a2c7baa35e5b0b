"""Issue 41 (a): what the decision does on described healthy machines, with and without the model.

Each case of ``examples/machines/healthy/`` describes a healthy machine (NVLink pair, NVSwitch
eight, PCIe consumer cards with P2P off proven, PCIe data-centre cards), a model by its gradient
size (``gradient_bytes=``, what ``model=`` gives) and what each probe proved there. This script
decides each one exactly as ``resilient-strategy plan --simulate FILE`` does, once as written
(with the model) and once with the model's size removed, and prints the GPUs kept out of those
the job was given, per case and in total, as a Markdown table.

Before/after a change of the planner::

    git worktree add /tmp/base <commit>
    cp -r examples/machines/healthy /tmp/base/examples/machines/
    PYTHONPATH=/tmp/base/src python benchmarks/bench_healthy.py   # before
    PYTHONPATH=src python benchmarks/bench_healthy.py             # after

Parts (b) and (c) of the issue (samples/s against hand-written DDP, on CPU and on GPUs) are not
in this script yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEALTHY = ROOT / "examples" / "machines" / "healthy"
MODEL_KEYS = ("gradient_bytes", "param_bytes")


def decide(data: dict[str, Any]) -> tuple[int, str]:
    """(replicas, "backend xN accA") of the decision for one described case."""
    from resilient_strategy.cli import simulate_file

    with tempfile.TemporaryDirectory(prefix="rs-bench-healthy-") as tmp:
        path = Path(tmp) / "case.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        (sel,) = simulate_file(path).values()
    env = ",".join(f"{k}={v}" for k, v in sorted(sel.env.items()))
    what = f"{sel.backend}{' ' + env if env else ''} x{sel.num_replicas}"
    if sel.accumulation_steps > 1:
        what += f" acc {sel.accumulation_steps}"
    return sel.num_replicas, what


def rows(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        gpus = int(data["machine"]["gpus"])
        with_model = decide(data)
        without = decide({k: v for k, v in data.items() if k not in MODEL_KEYS})
        out.append({"case": path.stem, "framework": data["framework"], "gpus": gpus,
                    "gradient_bytes": data.get("gradient_bytes"),
                    "with_model": with_model, "without_model": without})
    return out


def table(found: list[dict[str, Any]]) -> str:
    lines = ["| case | framework | gradients | with model= | kept | without | kept |",
             "|---|---|---|---|---|---|---|"]
    for r in found:
        grad = f"{r['gradient_bytes'] / 1e6:,.0f} MB" if r["gradient_bytes"] else "-"
        (wk, ww), (nk, nw) = r["with_model"], r["without_model"]
        lines.append(f"| {r['case']} | {r['framework']} | {grad} | {ww} | {wk}/{r['gpus']} | "
                     f"{nw} | {nk}/{r['gpus']} |")
    total = sum(r["gpus"] for r in found)
    kept_with = sum(r["with_model"][0] for r in found)
    kept_without = sum(r["without_model"][0] for r in found)
    idle_with = sum(1 for r in found if r["with_model"][0] < r["gpus"])
    idle_without = sum(1 for r in found if r["without_model"][0] < r["gpus"])
    lines += ["", f"GPUs kept with model=: {kept_with}/{total} ({idle_with} of {len(found)} "
              f"machines leave GPUs idle); without: {kept_without}/{total} ({idle_without} of "
              f"{len(found)})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=HEALTHY)
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    found = rows(args.cases)
    print(json.dumps(found, indent=1) if args.json else table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
