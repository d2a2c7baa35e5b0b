"""The command line: doctor / plan / probe, --json, --simulate, on this GPU-less machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.cli import main

ROOT = Path(__file__).parents[1]
MACHINES = ROOT / "examples" / "machines"


def test_doctor_runs_without_a_gpu_in_a_fresh_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "resilient_strategy", "doctor"], env=env,
                         capture_output=True, text=True, timeout=deadline(120))
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


# ----- bad --simulate files: one clean line naming the file and the field ------------------------
@pytest.mark.parametrize(
    ("content", "field"),
    [
        ({"machine": {"gpus": 2, "cc": "9.0"}}, "cc"),
        ({"machine": {"gpus": "two"}}, "gpus"),
        ({"machine": {"gpus": -3}}, "gpus"),
        ({"machine": {"gpus": 2, "nvlink": "x"}}, "nvlink"),
        ({"machine": {"gpus": 2, "links": {"0-5": 4}}}, "links"),
        ({"machine": {"gpus": 2, "torch_archs": "sm_90"}}, "torch_archs"),
        ({"machine": {"gpus": 2}, "probes": {"nccl": "okay"}}, "probes"),
        ({"machine": {"gpus": 2}, "probes": ["nccl"]}, "probes"),
        ({"machine": {"gpus": 2}, "global_batch_size": 0}, "global_batch_size"),
        ({"machine": {"gpus": 2}, "framework": "pytorch"}, "framework"),
        ({"machine": {"gpus": 2}, "probe": {"nccl": "ok"}}, "probe"),
        ({"machine": [2]}, "machine"),
        ({"facts": {"gpus": "two"}}, "not a machine description"),
    ],
)
def test_bad_simulate_fields_are_one_clean_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, field: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(content))
    for command in ("doctor", "plan"):
        assert main([command, "--simulate", str(bad)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert str(bad) in err and field in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [["--global-batch-size", "0"], ["--global-batch-size", "-8"], ["--gradient-bytes", "0"],
     ["--logical-cpus", "-1"], ["--framework", "torch", "--logical-cpus", "2"]],
)
def test_out_of_range_options_are_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--simulate", str(MACHINES / "h200x2_nvlink.json"), *argv])
    assert exit_info.value.code == 2
    assert argv[-2] in capsys.readouterr().err


def test_global_batch_size_option_wins_over_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--json", "--global-batch-size", "64",
                 "--simulate", str(MACHINES / "h200x2_nvlink.json")]) == 0
    dec = json.loads(capsys.readouterr().out)["decisions"]["torch"]
    assert dec["global_batch_size"] == 64


def test_doctor_with_logical_cpus_plans_torch_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = tmp_path / "both.json"
    both.write_text(json.dumps(
        {"machine": {"gpus": 2, "torch": "2.11.0", "tensorflow": "2.17.0", "tf_cuda": "12.3"}}))
    assert main(["doctor", "--logical-cpus", "2", "--simulate", str(both)]) == 0
    out = capsys.readouterr().out
    torch_part, tf_part = out.split("== torch ==")[1].split("== tensorflow ==")
    assert "logical CPU" not in torch_part and "chose: NCCL on GPUs 0,1" in torch_part
    assert "Test mode: 2 logical CPU devices stand in for GPUs." in tf_part


# ----- --rules / --disable-rule and their environment variables ----------------------------------
_LAB_RULE = ('[[rule]]\nid = "lab-no-nccl"\nwhen = ["gpus.names matches H200"]\neffect = "veto"\n'
             'target = "nccl"\nmessage = "our H200 box has a bad NVSwitch"\nsource = "ticket 42"\n')


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["plan", "--json", *argv]) == 0
    (dec,) = json.loads(capsys.readouterr().out)["decisions"].values()
    return dec  # type: ignore[no-any-return]


def test_rules_and_disable_rule_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lab = tmp_path / "lab.toml"
    lab.write_text(_LAB_RULE)
    h200 = ["--simulate", str(MACHINES / "h200x2_nvlink.json")]
    assert _plan(h200, capsys)["backend"] == "nccl"
    dec = _plan([*h200, "--rules", str(lab)], capsys)
    assert dec["backend"] != "nccl" and "lab-no-nccl" in dec["rules_fired"]
    seed003 = ["--simulate", str(MACHINES / "seed003_a6000x8_shm.json")]
    assert "small-dev-shm" in _plan(seed003, capsys)["rules_fired"]
    dec = _plan([*seed003, "--disable-rule", "small-dev-shm", "--disable-rule", "mixed-gpus"], capsys)
    assert "small-dev-shm" not in dec["rules_fired"]


def test_bad_rules_file_option_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text(_LAB_RULE.replace("gpus.names", "gpu.names"))
    assert main(["plan", "--rules", str(typo), "--simulate", str(MACHINES / "h200x2_nvlink.json")]) == 2
    err = capsys.readouterr().err
    assert str(typo) in err and "unknown fact 'gpu.names'" in err


def test_simulate_honours_the_rule_variables_of_your_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lab = tmp_path / "lab.toml"
    lab.write_text(_LAB_RULE)
    monkeypatch.setenv("RESILIENT_STRATEGY_RULES", str(lab))
    dec = _plan(["--simulate", str(MACHINES / "h200x2_nvlink.json")], capsys)
    assert "lab-no-nccl" in dec["rules_fired"] and dec["backend"] != "nccl"
    monkeypatch.setenv("RESILIENT_STRATEGY_DISABLE_RULES", "small-dev-shm,container-shm-remedy")
    dec = _plan(["--simulate", str(MACHINES / "seed003_a6000x8_shm.json")], capsys)
    assert not {"small-dev-shm", "container-shm-remedy"} & set(dec["rules_fired"])


def test_json_carries_the_typed_trace(capsys: pytest.CaptureFixture[str]) -> None:
    case = Path(__file__).parents[1] / "examples" / "machines" / "seed001_sagemaker_p3_8xlarge.json"
    assert main(["plan", "--simulate", str(case), "--json"]) == 0
    decision = json.loads(capsys.readouterr().out)["decisions"]["torch"]
    events = decision["events"]
    assert decision["simulated"] is True
    assert events[0]["kind"] == "framework_picked" and events[-1]["kind"] == "chosen"
    hangs = [e for e in events if e["kind"] == "ruled_out" and e["by"] == "probe"]
    assert [e["result"]["status"] for e in hangs] == ["timeout"] * 3
    assert {e["rule"] for e in events if e["kind"] == "rule_fired"} == {
        "aws-ofi-without-efa", "sagemaker-dataparallel"}
    assert [e["text"] for e in events if e["text"]] == decision["trace"]
