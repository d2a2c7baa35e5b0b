"""Every subcommand's exit statuses, as docs/reference/cli.md lists them; and doctor's link matrix.

doctor / plan / probe: 0 done; 2 a usage or input error (argparse's own 2 included). run: 2 when
it cannot start (no torch, a bad option, no such script); its 0 / 1 / 128+N after a launch are
tested with real workers in test_supervisor.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.cli import EXIT_OK, EXIT_USAGE, link_matrix, main
from resilient_strategy.testing import machine

ROOT = Path(__file__).parents[1]
H200 = str(ROOT / "examples" / "machines" / "h200x2_nvlink.json")


def _sim(tmp_path: Path, data: object, name: str = "m.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("command", ["doctor", "plan", "probe"])
def test_a_simulated_machine_exits_0(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--simulate", H200]) == EXIT_OK == 0
    capsys.readouterr()
    assert main([command, "--simulate", H200, "--json"]) == EXIT_OK
    assert set(json.loads(capsys.readouterr().out)["decisions"]) == {"torch"}


@pytest.mark.parametrize("command", ["doctor", "plan", "probe"])
@pytest.mark.parametrize("argv", [["--framework", "jax"], ["--global-batch-size", "0"],
                                  ["--no-such-option"]])
def test_a_bad_argument_exits_2(command: str, argv: list[str],
                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, *argv])
    assert done.value.code == EXIT_USAGE == 2


@pytest.mark.parametrize("command", ["doctor", "plan", "probe"])
def test_an_unreadable_input_or_unknown_rule_exits_2(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--simulate", str(tmp_path / "missing.json")]) == EXIT_USAGE
    assert main([command, "--simulate", _sim(tmp_path, [1, 2])]) == EXIT_USAGE
    assert main([command, "--simulate", H200, "--disable-rule", "no-such-rule"]) == EXIT_USAGE


def test_probe_with_no_framework_installed_exits_2_while_doctor_and_plan_exit_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = _sim(tmp_path, {"machine": {"gpus": 2, "torch": None}})
    assert main(["doctor", "--simulate", bare]) == EXIT_OK
    assert main(["plan", "--simulate", bare]) == EXIT_OK
    assert main(["probe", "--simulate", bare]) == EXIT_USAGE
    assert main(["probe", "--simulate", bare, "--json"]) == EXIT_USAGE


def test_version_and_help_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["--help"], ["doctor", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_run_that_cannot_start_exits_2(tmp_path: Path) -> None:
    assert main(["run", str(tmp_path / "no_such_script.py")]) == EXIT_USAGE
    assert main(["run", "--max-relaunches", "-1", str(tmp_path / "x.py")]) == EXIT_USAGE


# ------------------------------------------------------------------------------------------
# doctor's link matrix (nvidia-smi topo -m)
# ------------------------------------------------------------------------------------------
def test_the_link_matrix_reads_like_nvidia_smi_topo() -> None:
    facts = machine(4, links={"0-1": 4, "2-3": {"topology": "system", "p2p": "not_supported"}})
    rows = link_matrix(facts)
    assert rows[0] == ("", "GPU0", "GPU1", "GPU2", "GPU3")
    assert rows[1] == ("GPU0", "X", "NV4", "PHB", "PHB")
    assert rows[3] == ("GPU2", "PHB", "PHB", "X", "SYS")
    assert all(rows[i][j] == rows[j][i] for i in range(1, 5) for j in range(1, 5))


def test_doctor_prints_the_matrix_for_a_simulated_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = _sim(tmp_path, {"machine": {"gpus": 2, "links": {"0-1": 18}}, "framework": "torch"})
    assert main(["doctor", "--simulate", m]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in out if line.strip().startswith("GPU0") and "X" in line)
    assert row == ["GPU0", "X", "NV18"]
    assert link_matrix(machine(1)) == (("", "GPU0"), ("GPU0", "X"))


# ------------------------------------------------------------------------------------------
# probe leaves nothing behind
# ------------------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_probe_for_a_planned_torchrun_launch_leaves_no_agreement_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "RESILIENT_STRATEGY_PROBE_FAULT", "RESILIENT_STRATEGY_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RESILIENT_STRATEGY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["probe", "--framework", "torch", "--nproc-per-node", "2", "--json"]) == EXIT_OK
    decision = json.loads(capsys.readouterr().out)["decisions"]["torch"]
    assert (decision["backend"], decision["launch_world_size"]) == ("gloo", 2)
    assert sorted(p.name for p in tmp_path.rglob("agree-*")) == []


# ------------------------------------------------------------------------------------------
# a command line that behaves like one
# ------------------------------------------------------------------------------------------
def test_the_top_level_help_lists_every_subcommand() -> None:
    from resilient_strategy.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"doctor", "plan", "probe", "cache", "run"}  # type: ignore[arg-type]


def test_nproc_per_node_beats_a_launch_the_simulation_describes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launched = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    m = _sim(tmp_path, {"machine": {"gpus": 2, "env": launched}, "framework": "torch"})
    assert main(["plan", "--simulate", m, "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["decisions"]["torch"]["launch_world_size"] == 2
    assert main(["plan", "--simulate", m, "--json", "--nproc-per-node", "1"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["decisions"]["torch"]["launch_world_size"] == 1


@pytest.mark.slow
def test_a_reader_that_leaves_early_is_no_error(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for argv in (["doctor", "--json", "--simulate", H200], ["doctor", "--simulate", H200]):
        with subprocess.Popen([sys.executable, "-m", "resilient_strategy", *argv], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()  # `| head` gone before the first line
            err = proc.stderr.read().decode()
            assert proc.wait(timeout=deadline(60)) == EXIT_OK, err
        assert "Traceback" not in err and "BrokenPipeError" not in err


def test_cache_show_and_clear_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RESILIENT_STRATEGY_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["cache", "show", "--json"]) == EXIT_OK
    assert main(["cache", "clear"]) == EXIT_OK  # nothing there is not an error
    assert main(["cache", "clear", "--fingerprint", "0123456789abcdef"]) == 1  # nothing cached
    assert main(["cache", "clear", "--fingerprint", "../etc"]) == EXIT_USAGE  # not a fingerprint
    with pytest.raises(SystemExit) as done:
        main(["cache"])
    assert done.value.code == EXIT_USAGE
