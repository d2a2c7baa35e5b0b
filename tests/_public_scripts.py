"""The harness of the public-scripts suite (tests/test_public_scripts.py,
tests/test_public_scripts_frameworks.py): a script's environment (the instrument of
tests/public_scripts/_count on the path), its counts, torchrun, ``python`` and a supervised run
with one rank SIGKILLed mid-run, and the processes left."""


from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from conftest import deadline

from resilient_strategy.machine.procs import pids_with_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "public_scripts"
BROKEN_GLOO = {"GLOO_SOCKET_IFNAME": "nonexistent"}


def _env(tmp: Path, name: str, report: Path, **extra: str) -> dict[str, str]:
    """This test's environment for a script's processes: none of ours (the measured switch as the
    suite sets it), the instrument and the script's folder on the path, a cache of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
           or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    path = [str(SCRIPTS / "_count"), str(SCRIPTS / name), str(ROOT / "src")]
    report.mkdir(parents=True, exist_ok=True)
    (tmp / "tmp").mkdir(exist_ok=True)
    env.update(PYTHONPATH=os.pathsep.join(path), PUBLIC_SCRIPTS_REPORT=str(report),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp / "tmp"),
               RESILIENT_STRATEGY_CACHE_DIR=str(tmp / "cache"), **extra)
    return env


def _reports(report: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> what each of its processes trained, in the order they started."""
    found: dict[int, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for path in report.glob("rank*-*.json"):
        rank, pid = path.stem[4:].split("-")
        data = {**json.loads(path.read_text()), "pid": int(pid)}
        found[int(rank)].append((path.stat().st_mtime, data))
    return {rank: [d for _, d in sorted(runs, key=lambda r: r[0])] for rank, runs in found.items()}


def _left(report: Path) -> list[int]:
    """The processes of this run still alive (by the report directory in their environment)."""
    end = time.monotonic() + deadline(10)
    while True:
        left = pids_with_env({"PUBLIC_SCRIPTS_REPORT": str(report)})
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def torchrun(tmp: Path, name: str, which: str, *args: str, **extra: str) -> tuple[
        subprocess.CompletedProcess[str], dict[int, list[dict[str, Any]]]]:
    """``torchrun --nproc_per_node 2 <name>/<which>.py args`` in a fresh directory ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    report = tmp / "report"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", str(SCRIPTS / name / f"{which}.py"), *args]
    done = subprocess.run(argv, cwd=tmp, env=_env(tmp, name, report, **extra),
                          capture_output=True, text=True, timeout=deadline(300))
    assert not _left(report)
    return done, _reports(report)


def supervised_kill(tmp: Path, name: str, *args: str, nproc: int = 2, rank: int = 1,
                    at: int, step_s: float = 0.03, framework_var: str = "steps",
                    **extra: str) -> tuple[subprocess.Popen[str], str, list[dict[str, Any]],
                                           dict[int, list[dict[str, Any]]]]:
    """``resilient-strategy run --nproc-per-node nproc <name>/adopted.py args``, each step
    ``step_s`` longer; once ``rank`` has counted ``at`` (``framework_var``: optimizer ``steps``,
    or Keras' training ``batches``), its training process is SIGKILLed (its pid is its report's
    name). Returns the supervisor, its output, its attempts record and the counts."""
    tmp.mkdir(parents=True, exist_ok=True)
    report = tmp / "report"
    env = _env(tmp, name, report, PUBLIC_SCRIPTS_STEP_S=str(step_s), **extra)
    argv = [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", str(nproc),
            str(SCRIPTS / name / "adopted.py"), *args]
    proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        end = time.monotonic() + deadline(240)
        victim = None
        while victim is None and time.monotonic() < end and proc.poll() is None:
            runs = _reports(report).get(rank, [])
            if runs and runs[-1][framework_var] >= at:
                victim = runs[-1]["pid"]
            else:
                time.sleep(0.05)
        assert victim is not None, "the rank never reached the step"
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdout is not None and not proc.stdout.closed:  # its pipe closed on every path
            proc.communicate(timeout=30)
    assert not _left(report), out[-3000:]
    records = list((tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
    attempts = json.loads(records[0].read_text())["attempts"] if records else []
    return proc, out, attempts, _reports(report)


def only(reports: dict[int, list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """rank -> its one process's counts (a run without relaunches)."""
    assert all(len(runs) == 1 for runs in reports.values()), reports
    return {rank: runs[0] for rank, runs in reports.items()}




def python(tmp: Path, name: str, which: str) -> tuple[subprocess.CompletedProcess[str],
                                                        dict[int, list[dict[str, Any]]]]:
    """``python <name>/<which>.py`` in a fresh directory ``tmp`` (how the guide runs)."""
    tmp.mkdir(parents=True, exist_ok=True)
    report = tmp / "report"
    done = subprocess.run([sys.executable, str(SCRIPTS / name / f"{which}.py")], cwd=tmp,
                          env=_env(tmp, name, report, TF_CPP_MIN_LOG_LEVEL="2"),
                          capture_output=True, text=True, timeout=deadline(300))
    assert not _left(report)
    return done, _reports(report)
