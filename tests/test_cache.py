"""The decision cache: atomic JSON per fingerprint, expiry, corrupt and unwritable files."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from resilient_strategy.cache import DecisionCache, default_dir
from resilient_strategy.probe import ProbeResult

OK = ProbeResult("torch:nccl:0,1", "ok", 8.1, bus_bandwidth_gbps=301.5, ranks=2)
BAD = ProbeResult("torch:gloo:0,1", "timeout", 30.0, "timeout", "ranks [1] did not finish")


def test_round_trip_and_merge(tmp_path: Path) -> None:
    cache = DecisionCache(tmp_path)
    assert cache.load("fp1") == {}
    assert cache.store("fp1", {OK.candidate: OK}, now=1000.0)
    assert cache.store("fp1", {BAD.candidate: BAD}, now=1001.0)
    got = cache.load("fp1", now=1002.0)
    assert got == {OK.candidate: OK, BAD.candidate: BAD}
    assert cache.load("fp2", now=1002.0) == {}  # another machine
    assert not list(tmp_path.glob(".tmp-*"))  # no temp files left behind


def test_expiry(tmp_path: Path) -> None:
    cache = DecisionCache(tmp_path, ttl_s=60)
    cache.store("fp", {OK.candidate: OK}, now=0.0)
    assert cache.load("fp", now=59.0) == {OK.candidate: OK}
    assert cache.load("fp", now=61.0) == {}


@pytest.mark.parametrize("content", ["{not json", '{"version": 1}', "[]", '{"version": 99}'])
def test_corrupt_file_is_set_aside_with_a_warning(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DecisionCache(tmp_path)
    cache.path("fp").write_text(content)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.load("fp") == {}
    assert "unreadable" in caplog.text
    assert (tmp_path / "fp.corrupt").read_text() == content  # nothing the user had is lost
    assert cache.store("fp", {OK.candidate: OK})
    assert cache.load("fp") == {OK.candidate: OK}


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory_degrades(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert not DecisionCache(ro / "sub").store("fp", {OK.candidate: OK})
    assert "cannot write" in caplog.text


def test_directory_that_is_a_file_degrades(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert not DecisionCache(blocker / "cache").store("fp", {OK.candidate: OK})
        assert DecisionCache(blocker / "cache").load("fp") == {}
    assert "cannot write" in caplog.text


def test_file_format_is_readable_json(tmp_path: Path) -> None:
    DecisionCache(tmp_path).store("fp", {OK.candidate: OK}, now=5.0)
    data = json.loads((tmp_path / "fp.json").read_text())
    assert data["fingerprint"] == "fp" and data["results"][OK.candidate]["at"] == 5.0


def test_default_dir_precedence() -> None:
    assert default_dir({"RESILIENT_STRATEGY_CACHE_DIR": "/x"}) == Path("/x")
    assert default_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/resilient_strategy")
    assert default_dir({"HOME": "/h"}) == Path("/h/.cache/resilient_strategy")
