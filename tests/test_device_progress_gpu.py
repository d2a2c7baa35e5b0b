"""Progress that follows the device, on a real GPU (skipped without CUDA): a collective's CUDA
event polled from the worker's thread tells "enqueued, not completed" from "completed"; and,
on two GPUs with NCCL, a real SIGSTOP of one rank is a stall naming it, the job resumed on the
same strategy (the lead runs these; benchmarks/bench_realfaults.py --backend nccl prints the
table)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from resilient_strategy.records.progress import DevicePoller, ProgressWriter, read_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_an_event_behind_a_long_kernel_is_seen_enqueued_then_completed(tmp_path: Path) -> None:
    path = str(tmp_path / "r0")
    w = ProgressWriter(path)

    def mark() -> object:
        event = torch.cuda.Event()
        event.record()
        return event

    poller = DevicePoller(w, mark, interval_s=3600.0)  # polled by hand below
    w.enter(1)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles, enqueued: returns at once
    w.leave(1)
    poller.record(1)
    assert poller.poll_once() is True
    rec = read_record(path)
    assert rec is not None and (rec.phase, rec.k, rec.dev) == ("collective_done", 1, 0)
    torch.cuda.synchronize()
    assert poller.poll_once() is False
    rec = read_record(path)
    assert rec is not None and rec.dev == 1
    w.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stopped_rank_under_nccl_is_a_stall_naming_it(rank: int, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_realfaults",
                                                  ROOT / "benchmarks" / "bench_realfaults.py")
    assert spec is not None and spec.loader is not None
    rf = importlib.util.module_from_spec(spec)
    sys.modules["bench_realfaults"] = rf
    spec.loader.exec_module(rf)
    args = argparse.Namespace(src=str(ROOT / "src"), step_s=0.05, steps=60,
                              cache=tmp_path / "cache", backend="nccl", run_args=[],
                              deadline=300.0)
    run = rf.Run(args, tmp_path / "run", {})
    run.start()
    assert run.wait_step(rank, 12)
    for pid in run.rank_pids(rank):
        os.kill(pid, signal.SIGSTOP)
    fault_at = time.time()
    row = run.finish(rf.Row("sigstop"), fault_at)
    out = (tmp_path / "run" / "output.txt").read_text()[-3000:]
    assert (row.verdict, row.ranks, row.action, row.exit_code, row.left) == (
        "stall", [rank], "retry", 0, 0), out
