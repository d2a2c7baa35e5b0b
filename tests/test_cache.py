"""The decision cache: atomic JSON per fingerprint, expiry, corrupt and unwritable files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.core.call.options import default_dir
from resilient_strategy.core.measures.probe import ProbeResult
from resilient_strategy.deciding.cache import DecisionCache

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
    # nothing the user had is lost
    assert cache.path("fp").with_suffix(".corrupt").read_text() == content
    assert cache.store("fp", {OK.candidate: OK})
    assert cache.load("fp") == {OK.candidate: OK}


def test_directory_that_is_a_file_degrades(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert not DecisionCache(blocker / "cache").store("fp", {OK.candidate: OK})
        assert DecisionCache(blocker / "cache").load("fp") == {}
    assert "cannot write" in caplog.text


def test_file_format_is_readable_json(tmp_path: Path) -> None:
    DecisionCache(tmp_path).store("fp", {OK.candidate: OK}, now=5.0)
    data = json.loads((tmp_path / "fp.v1.json").read_text())
    assert data["fingerprint"] == "fp" and data["results"][OK.candidate]["at"] == 5.0


def test_default_dir_precedence() -> None:
    assert default_dir({"RESILIENT_STRATEGY_CACHE_DIR": "/x"}) == Path("/x")
    assert default_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/resilient_strategy")
    assert default_dir({"HOME": "/h"}) == Path("/h/.cache/resilient_strategy")


def _entry(**result: object) -> dict[str, object]:
    return {"at": 5.0, "result": {**OK.to_dict(), **result}}


def _file(results: object) -> str:
    return json.dumps({"version": 1, "fingerprint": "fp", "results": results})


@pytest.mark.parametrize("content", [
    b"\xff\xfe not utf-8 \x80",
    b'{"version": 1, "fingerprint": "fp", "results": {"k": "\xe9t\xe9"}}',  # latin-1 bytes
    b'["a", "list"]',
    b'{"version": 1, "fingerprint": "fp", "results": []}',
    _file({OK.candidate: _entry(bus_bandwidth_gbps="fast")}).encode(),
    _file({OK.candidate: _entry(elapsed_s=None)}).encode(),
    _file({OK.candidate: _entry(status="weird")}).encode(),
    _file({OK.candidate: _entry(cause="not_a_cause")}).encode(),
    _file({OK.candidate: _entry(ranks="2")}).encode(),
    _file({OK.candidate: _entry(extra="k=v")}).encode(),
    _file({OK.candidate: _entry(bus_bandwidth_gbps=float("nan"))}).encode(),  # NaN in JSON
    _file({OK.candidate: _entry(step_seconds=float("inf"))}).encode(),
    _file({OK.candidate: {"at": float("inf"), "result": OK.to_dict()}}).encode(),
    _file({OK.candidate: {"at": "yesterday", "result": OK.to_dict()}}).encode(),
    _file({OK.candidate: {"at": 5.0, "result": None}}).encode(),
    _file({OK.candidate: {"at": 5.0}}).encode(),
    _file({"torch:gloo:0,1": _entry()}).encode(),  # the result of another candidate
    _file({OK.candidate: [5.0, OK.to_dict()]}).encode(),
])
def test_corrupt_contents_degrade_never_raise(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DecisionCache(tmp_path)
    cache.path("fp").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.load("fp", now=6.0) == {}
    assert "unreadable" in caplog.text
    assert cache.path("fp").with_suffix(".corrupt").read_bytes() == content
    assert not cache.path("fp").exists()
    assert cache.store("fp", {OK.candidate: OK}, now=7.0)
    assert cache.load("fp", now=8.0) == {OK.candidate: OK}


def test_store_over_a_corrupt_file_sets_it_aside(tmp_path: Path) -> None:
    cache = DecisionCache(tmp_path)
    cache.path("fp").write_bytes(b"\xff\xfe")
    assert cache.store("fp", {OK.candidate: OK}, now=7.0)
    assert cache.path("fp").with_suffix(".corrupt").read_bytes() == b"\xff\xfe"
    assert cache.load("fp", now=8.0) == {OK.candidate: OK}


def test_a_result_that_cannot_be_read_back_is_not_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DecisionCache(tmp_path)
    nan = ProbeResult("torch:nccl:0", "ok", 1.0, bus_bandwidth_gbps=float("nan"))
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.store("fp", {nan.candidate: nan, "other-key": OK, BAD.candidate: BAD}, now=1.0)
    assert "not caching" in caplog.text
    assert cache.load("fp", now=2.0) == {BAD.candidate: BAD}  # the file stays readable


def test_entry_from_the_future_expires(tmp_path: Path) -> None:
    cache = DecisionCache(tmp_path, ttl_s=60)
    cache.store("fp", {OK.candidate: OK}, now=1_000_000.0)  # written by a clock far ahead
    assert cache.load("fp", now=1_000_000.0 - 61) == {}
    assert cache.load("fp", now=1_000_000.0 - 59) == {OK.candidate: OK}


def test_other_format_versions_are_left_alone(tmp_path: Path) -> None:
    cache = DecisionCache(tmp_path)
    other = {"version": 2, "fingerprint": "fp", "results": {"x": {"new": "layout"}}}
    (tmp_path / "fp.v2.json").write_text(json.dumps(other))
    (tmp_path / "fp.json").write_text("written by an older release")
    assert cache.load("fp") == {}
    assert cache.store("fp", {OK.candidate: OK})
    assert cache.load("fp") == {OK.candidate: OK}
    assert json.loads((tmp_path / "fp.v2.json").read_text()) == other
    assert (tmp_path / "fp.json").read_text() == "written by an older release"
    assert not list(tmp_path.glob("*.corrupt"))


_WRITER = """
import sys, time
from pathlib import Path
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.core.measures.probe import ProbeResult
directory, worker, start = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
while time.time() < start:
    time.sleep(0.001)
cache = DecisionCache(directory)
for i in range(20):
    key = f"torch:nccl:{worker}-{i}"
    assert cache.store("fp", {key: ProbeResult(key, "ok", float(i))})
"""


@pytest.mark.slow
def test_concurrent_writers_keep_every_result(tmp_path: Path) -> None:
    start = time.time() + 1.5  # every writer begins at once
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w), str(start)],
                         stderr=subprocess.PIPE, text=True)
        for w in range(4)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=deadline(60))
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=deadline(10))
    got = DecisionCache(tmp_path).load("fp")
    assert sorted(got) == sorted(f"torch:nccl:{w}-{i}" for w in range(4) for i in range(20))
    assert (tmp_path / "fp.lock").exists()


# ----- trust: what another user planted, and bounds ------------------------------------------
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0,
                             reason="giving a file to another uid (os.chown) needs root")


@as_root
def test_a_cache_file_planted_by_another_user_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DecisionCache(tmp_path)
    cache.store("fp", {BAD.candidate: BAD}, now=1.0)
    os.chown(cache.path("fp"), NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.load("fp", now=2.0) == {}
    line = [r.getMessage() for r in caplog.records if str(cache.path("fp")) in r.getMessage()]
    assert len(line) == 1 and f"owned by uid {NOBODY}" in line[0] and "Remove" in line[0]
    assert cache.path("fp").exists() and not list(tmp_path.glob("*.corrupt"))  # not ours to move


@as_root
def test_a_cache_directory_symlinked_by_another_user_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(elsewhere)
    os.lchown(link, NOBODY, NOBODY)
    cache = DecisionCache(link)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert not cache.store("fp", {OK.candidate: OK})
        assert cache.load("fp") == {}
    assert list(elsewhere.iterdir()) == []  # nothing written where the link points
    assert f"symbolic link owned by uid {NOBODY}" in caplog.text and str(link) in caplog.text


def test_a_cache_directory_open_to_everyone_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    DecisionCache(shared).store("fp", {BAD.candidate: BAD}, now=1.0)
    shared.chmod(0o777)  # anyone could have planted or replaced that file
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert DecisionCache(shared).load("fp", now=2.0) == {}
        assert not DecisionCache(shared).store("fp", {OK.candidate: OK})
    assert "writable by others (mode 777)" in caplog.text and "chmod go-w" in caplog.text


def test_the_cache_directory_is_created_0700_even_under_umask_000(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        assert DecisionCache(tmp_path / "home" / ".cache" / "rs").store("fp", {OK.candidate: OK})
    finally:
        os.umask(old)
    for d in (tmp_path / "home", tmp_path / "home" / ".cache", tmp_path / "home" / ".cache" / "rs"):
        assert oct(d.stat().st_mode & 0o777) == oct(0o700)
    assert (tmp_path / "home" / ".cache" / "rs" / "fp.v1.json").stat().st_mode & 0o077 == 0


def test_a_symlinked_lock_makes_no_file_where_it_points(tmp_path: Path) -> None:
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    DecisionCache(tmp_path).lock_path("fp").symlink_to(victim)
    assert DecisionCache(tmp_path).store("fp", {OK.candidate: OK})  # without the lock
    assert not victim.exists()


def test_a_deeply_nested_cache_file_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DecisionCache(tmp_path)
    deep = '{"version": 1, "fingerprint": "fp", "results": ' + "[" * 200_000 + "]" * 200_000 + "}"
    cache.path("fp").write_text(deep)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.load("fp") == {}
    assert "nested deeper than" in caplog.text
    assert cache.path("fp").with_suffix(".corrupt").exists() and not cache.path("fp").exists()
    assert cache.store("fp", {OK.candidate: OK}) and cache.load("fp") == {OK.candidate: OK}


def test_a_huge_cache_file_is_set_aside_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = DecisionCache(tmp_path)
    with open(cache.path("fp"), "wb") as fh:  # 400 MB, sparse
        fh.truncate(400 << 20)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.load("fp") == {}
    assert f"is {400 << 20} bytes" in caplog.text
    assert cache.path("fp").with_suffix(".corrupt").stat().st_size == 400 << 20


def test_seen_counts_runs_in_a_row_with_the_same_outcome(tmp_path: Path) -> None:
    cache = DecisionCache(tmp_path)
    fail = BAD
    ok = ProbeResult(BAD.candidate, "ok", 3.0)
    for now, res, seen in [(1.0, fail, 1), (2.0, fail, 2), (3.0, fail, 3), (4.0, ok, 1),
                           (5.0, ok, 2), (6.0, fail, 1)]:
        assert cache.store("fp", {res.candidate: res}, now=now)
        assert cache.entries("fp", now=now)[BAD.candidate].seen == seen
    # a file written before "seen" existed reads as one sighting
    data = json.loads(cache.path("fp").read_text())
    del data["results"][BAD.candidate]["seen"]
    cache.path("fp").write_text(json.dumps(data))
    assert cache.entries("fp", now=7.0)[BAD.candidate].seen == 1


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


_UNWRITABLE = """
import logging, sys
from pathlib import Path
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.core.measures.probe import ProbeResult
logging.basicConfig(level=logging.WARNING)
ok = ProbeResult("torch:nccl:0,1", "ok", 1.0)
assert not DecisionCache(Path(sys.argv[1]) / "sub").store("fp", {ok.candidate: ok})
assert DecisionCache(Path(sys.argv[1])).load("fp") == {}
"""


def test_an_unwritable_directory_degrades_also_for_root() -> None:
    """As root, the same check runs in a child that dropped to uid 65534."""
    as_nobody = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(prefix="rs-test-ro-"))
    try:
        ro = base / "ro"
        ro.mkdir()
        base.chmod(0o755)
        ro.chmod(0o755 if as_nobody else 0o500)  # root's 0755 directory: read-only for nobody
        try:
            p = subprocess.run([sys.executable, "-c", _UNWRITABLE, str(ro)], capture_output=True,
                               text=True, timeout=deadline(60),
                               preexec_fn=_as_nobody if as_nobody else None)
        except PermissionError:
            pytest.skip(f"uid {NOBODY} cannot run {sys.executable} here")
        assert p.returncode == 0, p.stderr
        assert "cannot write cache" in p.stderr
    finally:
        ro.chmod(0o700)
        shutil.rmtree(base)
