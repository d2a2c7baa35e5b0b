"""`cache show` / `cache clear` and the cache in `doctor` (issue 22.1): data and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.cli import main
from resilient_strategy.core.measures.probe import ProbeResult
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.machine import env as _env
from resilient_strategy.machine.inspect import detect_facts

OK = ProbeResult("torch:gloo:cpu", "ok", 2.5, bus_bandwidth_gbps=1.0, ranks=2)
POISON = ProbeResult("torch:cpu:cpu", "error", 0.0, "crash", "failed mid-run at step 3",
                     extra=(("mid_run", "3"),))


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("RESILIENT_STRATEGY_CACHE_DIR", str(d))
    return d


def _here() -> str:
    return detect_facts(_env.snapshot()).fingerprint()


def _fill(cache_dir: Path) -> str:
    cache = DecisionCache(cache_dir)
    here = _here()
    assert cache.store(here, {OK.candidate: OK})
    assert cache.store("0ther", {OK.candidate: OK})
    # an entry an older version wrote against the rules: listed, marked as ignored
    blob = json.loads(cache.path(here).read_text())
    blob["results"][POISON.candidate] = {"at": blob["results"][OK.candidate]["at"], "seen": 2,
                                         "result": POISON.to_dict()}
    cache.path(here).write_text(json.dumps(blob))
    return here


def _show(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["cache", "show", "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_show_an_empty_cache(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _show(capsys)
    assert data["fingerprints"] == {} and data["this_machine"] == _here()
    assert not cache_dir.exists()  # showing creates nothing


def test_show_lists_each_fingerprint_and_why_an_entry_is_ignored(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    here = _fill(cache_dir)
    fps = _show(capsys)["fingerprints"]
    assert isinstance(fps, dict) and set(fps) == {here, "0ther"}
    assert fps[here]["this_machine"] and not fps["0ther"]["this_machine"]
    rows = {e["candidate"]: e for e in fps[here]["entries"]}
    assert rows[OK.candidate]["ignored"] is None and rows[OK.candidate]["status"] == "ok"
    assert rows[POISON.candidate]["ignored"] is not None and rows[POISON.candidate]["seen"] == 2
    assert main(["cache", "show"]) == 0  # the text form too
    assert here in capsys.readouterr().out


def test_clear_this_machine_one_fingerprint_or_all(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    here = _fill(cache_dir)
    assert main(["cache", "clear"]) == 0  # this machine's only
    capsys.readouterr()
    assert set(_show(capsys)["fingerprints"]) == {"0ther"}  # type: ignore[call-overload]
    assert main(["cache", "clear", "--fingerprint", "0ther"]) == 0
    assert main(["cache", "clear", "--fingerprint", "0ther"]) == 1  # nothing there (a typo?)
    assert main(["cache", "clear", "--fingerprint", "../../etc/passwd"]) == 2
    _fill(cache_dir)
    assert main(["cache", "clear", "--all"]) == 0
    capsys.readouterr()
    assert _show(capsys)["fingerprints"] == {}
    assert DecisionCache(cache_dir).load(here) == {}
    with pytest.raises(SystemExit) as exc:
        main(["cache", "clear", "--all", "--fingerprint", "x"])
    assert exc.value.code == 2


def test_a_directory_not_safely_ours_is_exit_2(cache_dir: Path) -> None:
    cache_dir.mkdir(mode=0o700)
    cache_dir.chmod(0o777)
    assert main(["cache", "show"]) == 2
    assert main(["cache", "clear", "--all"]) == 2


def test_doctor_names_this_machines_entries(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    here = _fill(cache_dir)
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fingerprint"] == here
    assert {e["candidate"] for e in data["cache"]["entries"]} == {OK.candidate, POISON.candidate}


@pytest.mark.slow
def test_the_cli_says_when_the_cache_directory_is_not_safely_yours(tmp_path: Path) -> None:
    """The CLI quiets the library's logging, but not the ownership warnings (issue 22.5)."""
    import os
    import subprocess
    import sys

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "RESILIENT_STRATEGY_CACHE_DIR": str(shared)}
    out = subprocess.run([sys.executable, "-m", "resilient_strategy", "probe", "--framework",
                          "torch"], env=env, capture_output=True, text=True, timeout=deadline(120))
    assert out.returncode == 0, out.stderr
    assert str(shared) in out.stderr and "refused" in out.stderr
