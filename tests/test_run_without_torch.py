"""`resilient-strategy run` on a TensorFlow-only install (issue 20, item 7): torch is hidden from
the subprocesses by a ``sitecustomize`` on PYTHONPATH whose meta-path finder refuses ``torch``;
our own parser reads the command line and our one-process agent (run/solo.py) starts, watches
and relaunches the Keras example, which resumes through BackupAndRestore."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.run import cmdline

ROOT = Path(__file__).resolve().parents[1]

_HIDE_TORCH = '''
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return None


sys.meta_path.insert(0, _NoTorch())
'''


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    shim = tmp_path / "no-torch"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_HIDE_TORCH, encoding="utf-8")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update({"PYTHONPATH": os.pathsep.join([str(shim), str(ROOT / "src")]),
                "TMPDIR": str(tmp_path / "tmp"), "TF_CPP_MIN_LOG_LEVEL": "2",
                "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"), **extra})
    return env


def test_our_parser_reads_runs_options_without_torch(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setattr(cmdline, "torch_launcher", lambda: False)
    monkeypatch.delenv("RESILIENT_STRATEGY_STALL_TIMEOUT", raising=False)
    monkeypatch.delenv("RESILIENT_STRATEGY_MAX_RELAUNCHES", raising=False)
    script = tmp_path / "train.py"
    script.write_text("import tensorflow as tf\n", encoding="utf-8")
    opts = cmdline.options_from_args([
        "--nproc_per_node", "1", "--stall-timeout", "90", "--max-relaunches", "4",
        "--min-throughput", "0.5", "--allow-cpu", "--evidence-dir", "ev",
        "--global-batch-size", "512", "--logical-cpus", "2", str(script), "--epochs", "3"])
    assert (opts.script, opts.script_args, opts.framework, opts.nproc) == (
        str(script), ("--epochs", "3"), "tensorflow", 1)
    assert (opts.stall_timeout_s, opts.max_relaunches, opts.min_throughput, opts.allow_cpu,
            opts.evidence_dir, opts.global_batch_size, opts.logical_cpus) == (
        90.0, 4, 0.5, True, "ev", 512, 2)
    assert opts.torchrun is None  # no torchrun namespace: one node, our agent
    names = {s for a in cmdline.parser()._actions for s in a.option_strings}
    ours = {"--nproc-per-node", "--framework", "--global-batch-size", "--stall-timeout",
            "--max-relaunches", "--min-throughput", "--allow-cpu", "--evidence-dir",
            "--max-attempts-without-progress", "--logical-cpus", "--sharding"}
    assert ours <= names and "--nnodes" not in names  # torchrun's node options need torch


@pytest.mark.slow
def test_run_help_works_without_torch(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "resilient_strategy", "run", "--help"],
                          env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                          timeout=deadline(60))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--min-throughput" in proc.stdout and "--nnodes" not in proc.stdout


def _alive_with(marker: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    out.append(int(proc.name))
            except OSError:
                continue
    return out


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_keras_without_torch_retries_an_exit_and_resumes(tmp_path: Path) -> None:
    """A transient exit at step 12 (epoch 2 of 3, 8 steps an epoch): retried on the same
    strategy from the checkpoint at step 8; every epoch trained once; exit 0; nothing left."""
    env = _env(tmp_path, RESILIENT_STRATEGY_PREFER="hierarchical_copy",
               RESILIENT_STRATEGY_TIMEOUT="120",  # a loaded machine must not fail the probes
               RESILIENT_STRATEGY_TRAIN_FAULT="exit:0:hierarchical_copy:12:1")
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--logical-cpus", "2",
         "--stall-timeout", "60", str(ROOT / "examples" / "keras_train.py"), "--cpu-replicas",
         "2", "--samples", "2048", "--epochs", "3", "--checkpoint-dir", str(tmp_path / "backup")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=deadline(600),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = re.findall(r"resilient_strategy chose: (.*?)[.(]", proc.stdout)
    assert len(chosen) == 2 and all("HierarchicalCopy" in c for c in chosen)
    epochs = re.findall(r"^epoch (\d+):", proc.stdout, re.MULTILINE)
    assert epochs == ["1", "2", "3"]  # epoch 1 is not trained again after the retry
    [record] = (tmp_path / "resilient-strategy-evidence").glob("*/attempts.json")
    attempts = json.loads(record.read_text())["attempts"]
    assert [(a["candidate"].split(":")[1], a["verdict"]["kind"], a["verdict"]["step"],
             a["action"], a["resumed_from"]) for a in attempts] == [
        ("hierarchical_copy", "exit", 12, "retry", None),
        ("hierarchical_copy", "ok", 0, "finish", 8)]
    assert not (tmp_path / "backup").exists()  # BackupAndRestore removes it when training ends
    assert _alive_with(str(tmp_path)) == []  # no worker outlives the supervisor
    assert [p.name for p in (tmp_path / "tmp").iterdir()
            if not p.name.startswith("__autograph_generated_file")] == []


def test_a_torch_script_without_torch_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    from resilient_strategy.errors import InvalidOptionError

    monkeypatch.setattr(cmdline, "torch_launcher", lambda: False)
    script = tmp_path / "train.py"
    script.write_text("import torch\n", encoding="utf-8")
    with pytest.raises(InvalidOptionError) as err:
        cmdline.options_from_args([str(script)])
    assert err.value.option == "--framework"


_STOPPED_THEN_RAISES = '''
import os, signal, time
from pathlib import Path
from resilient_strategy.records.handoff import DECISION_VAR
from resilient_strategy.records.rundir import RunDir
from resilient_strategy.records.progress import ProgressWriter

writer = ProgressWriter(str(RunDir.of(Path(os.environ[DECISION_VAR]).parent).progress(0)))
writer.enter(1)  # enters the collective of step 1 and never leaves it


def on_term(signum, frame):  # as a tool's SIGTERM handler turns the stop into an error
    raise RuntimeError("Connection closed by peer")


signal.signal(signal.SIGTERM, on_term)
while True:
    time.sleep(0.05)
'''


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGTERM handler, /proc")
def test_the_one_process_agent_keeps_a_stall_whose_error_came_from_the_stop(
        tmp_path: Path) -> None:
    """run/solo.py judges an error record as torch's path does (agent.raised_before): one
    written after the stalled worker was stopped is what the stop did to it, not the story."""
    from resilient_strategy.core.call.options import RunOptions
    from resilient_strategy.records.handoff import HandedDecision, write_decision
    from resilient_strategy.records.rundir import RunDir
    from resilient_strategy.run.solo import launch_one
    from resilient_strategy.run.verdicts import VerdictKind

    script = tmp_path / "stalls.py"
    script.write_text(_STOPPED_THEN_RAISES, encoding="utf-8")
    run_dir = tmp_path / "attempt0"
    run_dir.mkdir()
    decision = HandedDecision(framework="tensorflow", chosen="tensorflow:single_device:0",
                        results={}, run_dir=str(run_dir))
    write_decision(run_dir / "decision.json", decision)
    verdict = launch_one(RunOptions(str(script), stall_timeout_s=1.0), decision, grace_s=10.0)
    assert json.loads(RunDir.of(run_dir).error(0).read_text())["types"][0] == "builtins.RuntimeError"
    assert (verdict.kind, verdict.step) == (VerdictKind.STALL, 1)
    assert _alive_with(str(script)) == []
