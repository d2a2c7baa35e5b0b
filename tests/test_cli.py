"""The command line: doctor / plan / probe, --json, --simulate, on this GPU-less machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_strategy.cli import main

ROOT = Path(__file__).parents[1]
MACHINES = ROOT / "examples" / "machines"


def test_doctor_runs_without_a_gpu_in_a_fresh_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "resilient_strategy", "doctor"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "GPUs the job can see:" in out.stdout and "Rules fired:" in out.stdout
    assert "resilient_strategy chose:" in out.stdout
    assert "Traceback" not in out.stderr


def test_doctor_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--simulate", str(MACHINES / "h200x2_nvlink.json")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["facts"]["gpus"]) == 2
    dec = data["decisions"]["torch"]
    assert dec["backend"] == "nccl" and dec["num_replicas"] == 2 and dec["global_batch_size"] == 512
    assert dec["candidates"][0]["key"] == "torch:nccl:0,1"


@pytest.mark.parametrize(
    ("name", "backend"),
    [("seed000_rtx5090_tf215.json", "hierarchical_copy"),
     ("seed001_sagemaker_p3_8xlarge.json", "gloo"),  # model unknown: ResNet-50-sized assumed
     ("seed002_rtx5090x4_pcie.json", "nccl"),
     ("seed003_a6000x8_shm.json", "nccl"),
     ("seed004_a30x2_tf_launcher.json", "single_device")],
)
def test_simulate_every_seed(name: str, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--simulate", str(MACHINES / name)]) == 0
    decisions = json.loads(capsys.readouterr().out)["decisions"]
    (dec,) = decisions.values()
    assert dec["backend"] == backend


def test_probe_command_prints_the_probe_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--simulate", str(MACHINES / "seed003_a6000x8_shm.json")]) == 0
    out = capsys.readouterr().out
    assert "Probes:" in out and "NCCL_SHM_DISABLE=1" in out and "Ruled out:" not in out.split("Probes:")[1]


def test_bad_simulate_file_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"machine": {"gpus": 2, "colour": "red"}}')
    assert main(["doctor", "--simulate", str(bad)]) == 2
    assert "not a machine description" in capsys.readouterr().err
    assert main(["doctor", "--simulate", str(tmp_path / "missing.json")]) == 2
