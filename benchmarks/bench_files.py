"""What the file checks cost: a cached decision's cache read (owner/mode checks, O_NOFOLLOW,
bounded parse), the agreement round trip, refusing hostile files (400 MB, 200k deep), and the
sweep of the temp directory a probing run does once.

    python benchmarks/bench_files.py [--repeat 200]

Prints a markdown table (median of --repeat runs, and peak extra memory where it matters).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from resilient_strategy.core.measures.probe import ProbeResult
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.machine import files as _files
from resilient_strategy.nodes.onenode import Agreement


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def peak_mib(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the refusals below log one warning each
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cache = DecisionCache(d / "cache")
        results = {f"torch:nccl:{i}": ProbeResult(f"torch:nccl:{i}", "ok", 1.0, ranks=2)
                   for i in range(12)}
        cache.store("fp", results)
        rows.append(("cache load, 12 entries (checked read + parse)",
                     median_ms(lambda: cache.load("fp"), args.repeat), ""))
        rows.append(("cache store, 12 entries (lock, merge, fsync, rename)",
                     median_ms(lambda: cache.store("fp", results), max(10, args.repeat // 10)), ""))
        ag = Agreement(d / "run" / "agree.json")
        payload = {"chosen": "torch:nccl:0", "from_cache": False, "proven": True,
                   "results": {k: v.to_dict() for k, v in results.items()}}

        def round_trip() -> None:
            ag.publish(payload)
            ag.wait(1.0, not_before=-math.inf)

        rows.append(("agreement publish + wait", median_ms(round_trip, max(10, args.repeat // 10)),
                     ""))
        huge = DecisionCache(d / "huge")
        _files.ensure_private_dir(huge.directory)

        def refuse_huge() -> None:
            with open(huge.path("fp"), "wb") as fh:
                fh.truncate(400 << 20)  # sparse
            huge.load("fp")

        rows.append(("refuse a 400 MB cache file", median_ms(refuse_huge, 5),
                     f"peak {peak_mib(refuse_huge):.2f} MiB"))
        deep = DecisionCache(d / "deep")
        _files.ensure_private_dir(deep.directory)

        def refuse_deep() -> None:
            deep.path("fp").write_text("[" * 200_000 + "]" * 200_000)
            deep.load("fp")

        rows.append(("refuse a 200k-deep cache file", median_ms(refuse_deep, 5),
                     f"peak {peak_mib(refuse_deep):.2f} MiB"))
        sweep = d / "tmp"
        sweep.mkdir()
        for i in range(1000):
            (sweep / f"other-{i}").mkdir()
        for i in range(20):
            (sweep / f"rs-probe-{os.getpid()}-{i}").mkdir()
        rows.append(("sweep a temp dir of 1,020 entries (20 ours, live)",
                     median_ms(lambda: _files.sweep_temp_dirs(str(sweep)), 20), ""))
    print("| operation | median ms | note |\n|---|---|---|")
    for name, ms, note in rows:
        print(f"| {name} | {ms:.3f} | {note} |")


if __name__ == "__main__":
    main()
