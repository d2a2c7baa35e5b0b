"""_files: private directories, checked and bounded reads, atomic writes, sweeping leftovers.

Files "planted by another user" are made with ``os.chown`` to uid 65534 (nobody), which needs
root (the suite runs as root in CI); as any other user those tests skip.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.errors import FileFormatError, ResilientStrategyError, UnsafePathError
from resilient_strategy.machine import files as _files

NOBODY = 65534
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="giving a file to another uid (os.chown) needs root",
)


def give_away(path: Path) -> Path:
    os.lchown(path, NOBODY, NOBODY)
    return path


# ----- directories ---------------------------------------------------------------------------
def test_created_directories_are_0700_under_any_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = _files.ensure_private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert _files.ensure_private_dir(made) == made  # already there: fine


@pytest.mark.parametrize("mode, who", [(0o777, "others"), (0o770, "its group"), (0o702, "others")])
def test_a_directory_open_to_others_is_refused(tmp_path: Path, mode: int, who: str) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(UnsafePathError, match=f"writable by {who}") as err:
        _files.ensure_private_dir(d)
    assert err.value.path == str(d) and "chmod go-w" in str(err.value)
    assert stat.S_IMODE(d.stat().st_mode) == mode  # refused, not silently changed


@as_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    give_away(d)
    with pytest.raises(UnsafePathError, match=f"owned by uid {NOBODY}, not by this user"):
        _files.ensure_private_dir(d)


@as_root
def test_a_symlink_of_another_user_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)  # even to a directory of ours
    link = tmp_path / "cache"
    link.symlink_to(target)
    give_away(link)
    with pytest.raises(UnsafePathError, match=f"symbolic link owned by uid {NOBODY}"):
        _files.ensure_private_dir(link)


def test_a_symlink_of_our_own_to_a_private_directory_is_fine(tmp_path: Path) -> None:
    target = tmp_path / "scratch"
    target.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(target)
    _files.ensure_private_dir(tmp_path / "cache")
    target.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by others"):
        _files.ensure_private_dir(tmp_path / "cache")


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UnsafePathError, match="not a directory"):
        _files.ensure_private_dir(tmp_path / "f")
    with pytest.raises(OSError):
        _files.ensure_private_dir(tmp_path / "f" / "sub")


# ----- reading -------------------------------------------------------------------------------
def test_read_bytes_of_our_own_file(tmp_path: Path) -> None:
    f = tmp_path / "x.json"
    f.write_bytes(b"12345")
    assert _files.read_bytes(f, max_bytes=5) == b"12345"
    with pytest.raises(FileFormatError, match="more than the 4"):
        _files.read_bytes(f, max_bytes=4)
    with pytest.raises(FileNotFoundError):
        _files.read_bytes(tmp_path / "missing", max_bytes=5)


def test_a_symlinked_file_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        _files.read_bytes(tmp_path / "link", max_bytes=10)
    # a file the user names (rules, machine files) may be a link
    assert _files.read_bytes(tmp_path / "link", max_bytes=10, owned=False) == b"{}"


@as_root
def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "planted.json"
    f.write_text("{}")
    give_away(f)
    with pytest.raises(UnsafePathError, match=f"owned by uid {NOBODY}"):
        _files.read_bytes(f, max_bytes=10)
    assert _files.read_bytes(f, max_bytes=10, owned=False) == b"{}"


def test_a_file_others_can_write_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "open.json"
    f.write_text("{}")
    f.chmod(0o666)
    with pytest.raises(UnsafePathError, match="writable by group or others"):
        _files.read_bytes(f, max_bytes=10)


def test_a_fifo_or_directory_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # opening a FIFO to read would wait for a writer forever
    for path in (tmp_path / "fifo", tmp_path):
        for owned in (True, False):
            with pytest.raises(UnsafePathError, match="not a regular file"):
                _files.read_bytes(path, max_bytes=10, owned=owned)


def test_a_huge_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    f = tmp_path / "huge.json"
    with open(f, "wb") as fh:  # 400 MB, sparse: costs no disk
        fh.truncate(400 << 20)
    with pytest.raises(FileFormatError, match=f"is {400 << 20} bytes"):
        _files.read_bytes(f, max_bytes=_files.MAX_CACHE_BYTES)


@pytest.mark.parametrize("text", [
    "[" * 200_000 + "]" * 200_000,
    '{"a":' * 200_000 + "1" + "}" * 200_000,
    "[" * 65 + "]" * 65,
])
def test_deep_json_is_a_typed_error(text: str) -> None:
    with pytest.raises(FileFormatError, match="nested deeper than 64"):
        _files.parse_json(text, "deep.json")


def test_json_at_the_depth_limit_parses() -> None:
    assert _files.parse_json("[" * 64 + "]" * 64, "ok.json") is not None


@pytest.mark.parametrize("text", [
    "a = " + "[" * 200_000 + "]" * 200_000,
    "a = " + "{b = " * 200_000 + "1" + "}" * 200_000,
    "[" + ".".join(["t"] * 100) + "]\nx = 1",  # deep by table headers: no recursion to hit
])
def test_deep_toml_is_a_typed_error(text: str) -> None:
    with pytest.raises(FileFormatError, match="nested deeper than 64"):
        _files.parse_toml(text, "deep.toml")


@pytest.mark.parametrize("data", [b"\xff\xfe", b"{", b"NaN", b'{"a": Infinity}', b""])
def test_what_is_not_json_is_a_typed_error(data: bytes) -> None:
    with pytest.raises(FileFormatError, match="not valid JSON"):
        _files.parse_json(data, "x.json")


# ----- writing -------------------------------------------------------------------------------
def test_atomic_write_leaves_one_private_file(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    _files.write_json_atomic(target, {"a": [1, 2]}, indent=1)
    assert json.loads(target.read_text()) == {"a": [1, 2]}
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with pytest.raises(ValueError):
        _files.write_json_atomic(target, {"a": float("nan")})
    with pytest.raises(TypeError):
        _files.write_json_atomic(target, {"a": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temp file left
    assert json.loads(target.read_text()) == {"a": [1, 2]}  # the old content stands


def test_lock_file_is_never_created_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (tmp_path / "x.lock").symlink_to(victim)
    with pytest.raises(OSError):
        _files.open_lock(tmp_path / "x.lock")
    assert not victim.exists()
    os.close(_files.open_lock(tmp_path / "y.lock"))
    assert stat.S_IMODE((tmp_path / "y.lock").stat().st_mode) == 0o600


# ----- sweeping ------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=deadline(30))
    return p.pid


def _aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_sweep_removes_only_old_dirs_of_dead_processes_of_ours(tmp_path: Path) -> None:
    dead = _dead_pid()
    left = tmp_path / f"rs-probe-{dead}-abc"
    left.mkdir()
    (left / "report-0.json").write_text("{}")
    _aged(left, 3600)
    young = tmp_path / f"rs-proc-{dead}-young"
    young.mkdir()
    alive = tmp_path / f"rs-proc-{os.getpid()}-live"
    alive.mkdir()
    _aged(alive, 3600)
    other = tmp_path / f"other-{dead}-x"
    other.mkdir()
    _aged(other, 3600)
    no_pid = tmp_path / "rs-probe-abc"
    no_pid.mkdir()
    _aged(no_pid, 3600)
    removed = _files.sweep_temp_dirs(str(tmp_path))
    assert removed == [str(left)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [young.name, alive.name, other.name, no_pid.name])


def test_sweep_leaves_a_name_whose_number_no_process_can_have(tmp_path: Path) -> None:
    """0 and numbers beyond a pid's type are not pids we wrote (they are left); a dead writer's
    files and directories are swept (the one liveness check, `machine/procs.alive`)."""
    dead = _dead_pid()
    for pid in (0, 1 << 31, 10 ** 30):
        d = tmp_path / f"rs-probe-{pid}-x"
        d.mkdir()
        _aged(d, 3600)
        (tmp_path / f".tmp-{pid}-x.pt").write_text("x")
    (tmp_path / f"rs-probe-{dead}-x").mkdir()
    _aged(tmp_path / f"rs-probe-{dead}-x", 3600)
    (tmp_path / f".tmp-{dead}-x.pt").write_text("x")
    assert _files.sweep_temp_dirs(str(tmp_path)) == [str(tmp_path / f"rs-probe-{dead}-x")]
    assert _files.sweep_orphan_files(tmp_path, (".tmp-",)) == [str(tmp_path / f".tmp-{dead}-x.pt")]
    assert len(list(tmp_path.iterdir())) == 6


@as_root
def test_sweep_leaves_other_users_dirs_and_symlinks(tmp_path: Path) -> None:
    dead = _dead_pid()
    theirs = tmp_path / f"rs-probe-{dead}-theirs"
    theirs.mkdir()
    give_away(theirs)
    _aged(theirs, 3600)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / f"rs-proc-{dead}-link").symlink_to(target)
    assert _files.sweep_temp_dirs(str(tmp_path), min_age_s=0) == []
    assert theirs.exists() and (target / "keep").exists()


def test_errors_are_typed() -> None:
    assert issubclass(UnsafePathError, ResilientStrategyError)
    assert issubclass(FileFormatError, ResilientStrategyError)
    assert issubclass(FileFormatError, ValueError)
