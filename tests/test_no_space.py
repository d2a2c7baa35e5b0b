"""Out of space is one line (issue 36.5): the files the supervisor and the workers write (the
run's decision, JSON records, checkpoints plain and sharded) handle a full or read-only
filesystem with a NoSpaceError naming the file, and what was already written stays whole.

On a real full filesystem where it can be had (root, a tiny tmpfs mounted for the test); the
error is also injected at the write seam, which runs everywhere."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.errors import NoSpaceError
from resilient_strategy.machine import files as _files

ROOT = Path(__file__).resolve().parents[1]


def _mount(target: Path, *options: str) -> bool:
    mount = shutil.which("mount")
    if mount is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    out = subprocess.run([mount, "-t", "tmpfs", "-o", ",".join(("size=256k", *options)),
                          "tmpfs", str(target)], capture_output=True, timeout=deadline(30))
    return out.returncode == 0


def _umount(target: Path) -> None:
    umount = shutil.which("umount") or "umount"
    subprocess.run([umount, "-l", str(target)], capture_output=True, timeout=deadline(30))


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root only); the test fills it."""
    target = tmp_path / "tiny"
    target.mkdir()
    if not _mount(target):
        pytest.skip("a full filesystem needs root and mount(8) (tmpfs): the injected tests "
                    "below cover the same seams")
    try:
        yield target
    finally:
        _umount(target)


def _fill(directory: Path, leave: int = 0) -> None:
    """Fill ``directory``'s filesystem until a write fails for space, then give back about
    ``leave`` bytes."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        with pytest.raises(OSError) as exc:
            for _ in range(1 << 16):
                os.write(fd, b"\0" * 4096)
        assert exc.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))


def _remount_read_only(target: Path) -> None:
    mount = shutil.which("mount") or "mount"
    subprocess.run([mount, "-o", "remount,ro", str(target)], check=True, timeout=deadline(30))


def _one_line(exc: BaseException) -> None:
    assert "\n" not in str(exc)


# ----- JSON records and the decision ---------------------------------------------------------
def test_a_json_record_on_a_full_disk_is_one_line_and_the_old_file_stays(tiny_fs: Path) -> None:
    path = tiny_fs / "attempts.json"
    _files.write_json_atomic(path, {"attempts": [1]})
    _fill(tiny_fs)
    with pytest.raises(NoSpaceError) as exc:
        _files.write_json_atomic(path, {"attempts": [1, 2] * 20_000})
    assert (exc.value.path, exc.value.read_only) == (str(path), False)
    _one_line(exc.value)
    assert json.loads(path.read_text()) == {"attempts": [1]}
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["attempts.json", "filler"]


def test_a_read_only_filesystem_is_one_line_too(tiny_fs: Path) -> None:
    path = tiny_fs / "decision.json"
    _files.write_json_atomic(path, {"v": 1})
    _remount_read_only(tiny_fs)
    with pytest.raises(NoSpaceError) as exc:
        _files.write_json_atomic(path, {"v": 2})
    assert (exc.value.path, exc.value.read_only) == (str(path), True)
    assert json.loads(path.read_text()) == {"v": 1}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_the_write_seam_turns_each_full_or_read_only_error_into_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    path = tmp_path / "record.json"
    _files.write_json_atomic(path, {"v": 1})

    def full(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(NoSpaceError) as exc:
        _files.write_json_atomic(path, {"v": 2})
    assert (exc.value.path, exc.value.read_only) == (str(path), code == errno.EROFS)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_another_os_error_passes_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError) as exc:
        _files.write_json_atomic(tmp_path / "x.json", {})
    assert not isinstance(exc.value, NoSpaceError) and exc.value.errno == errno.EIO


def test_the_handed_decision_on_a_full_disk(tiny_fs: Path) -> None:
    from resilient_strategy.records.handoff import HandedDecision, write_decision

    decision = HandedDecision(framework="torch", chosen="torch:gloo:cpu", results={},
                        run_dir=str(tiny_fs), processes=1)
    path = tiny_fs / "decision.json"
    write_decision(path, decision)
    before = path.read_bytes()
    _fill(tiny_fs)
    with pytest.raises(NoSpaceError) as exc:
        write_decision(path, HandedDecision(framework="torch", chosen="torch:gloo:cpu" + "x" * 300_000,
                                      results={}, run_dir=str(tiny_fs), processes=1))
    assert exc.value.path == str(path)
    assert path.read_bytes() == before


# ----- checkpoints ---------------------------------------------------------------------------
def _checkpointer(directory: Path, size: int, asynchronous: bool = False) -> Any:
    torch = pytest.importorskip("torch")
    from resilient_strategy.frameworks.checkpoint import Checkpointer

    model = torch.nn.Linear(size, size)
    ckpt = Checkpointer(directory, every_steps=1, asynchronous=asynchronous)
    ckpt.attach(model, None, None, None, 1)
    return ckpt, model


def _failed_save(ckpt: Any, asynchronous: bool) -> NoSpaceError:
    """The NoSpaceError of a save: raised by ``save`` itself (synchronous), or by the wait for
    its background write (asynchronous: ``save`` returns, the error comes at the next step,
    save, wait or shutdown), and recorded either way."""
    with pytest.raises(NoSpaceError) as exc:
        ckpt.save()
        assert asynchronous  # a synchronous save raised above
        ckpt.wait()
    assert ckpt.saves[-1].outcome == "failed"
    assert ckpt.saves[-1].mode == ("async" if asynchronous else "sync")
    return exc.value


@pytest.mark.torch
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_last_one_stays(
        tiny_fs: Path, asynchronous: bool) -> None:
    directory = tiny_fs / "ckpt"
    big, _ = _checkpointer(directory, 200, asynchronous)  # 160 KB: more than will be left
    ckpt, _ = _checkpointer(directory, 4, asynchronous)
    assert ckpt.save() and ckpt.wait()
    before = (directory / "checkpoint.pt").read_bytes()
    _fill(tiny_fs, leave=4096)
    exc = _failed_save(big, asynchronous)
    assert exc.path == str(directory / "checkpoint.pt")
    _one_line(exc)
    assert (directory / "checkpoint.pt").read_bytes() == before
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.torch
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_injected_full_keeps_the_last_one(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       asynchronous: bool) -> None:
    directory = tmp_path / "ckpt"
    ckpt, _ = _checkpointer(directory, 4, asynchronous)
    assert ckpt.save() and ckpt.wait()
    before = (directory / "checkpoint.pt").read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    exc = _failed_save(ckpt, asynchronous)
    assert exc.path == str(directory / "checkpoint.pt")
    assert (directory / "checkpoint.pt").read_bytes() == before
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.torch
def test_a_failed_background_write_stops_the_next_optimizer_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never silently lost: the training thread gets the write's NoSpaceError at its next
    optimizer step, as it would have from a synchronous save."""
    directory = tmp_path / "ckpt"
    ckpt, _ = _checkpointer(directory, 4, asynchronous=True)
    ckpt.micro_step(boundary=True, stepped=True)  # step 1: saved
    assert ckpt.wait()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    ckpt.micro_step(boundary=True, stepped=True)  # step 2: its write fails in the background
    ckpt._writer.wait()
    with pytest.raises(NoSpaceError):
        ckpt.micro_step(boundary=True, stepped=True)  # step 3
    assert [(r.step, r.outcome) for r in ckpt.saves] == [(1, "written"), (2, "failed")]
    monkeypatch.undo()
    back, _ = _checkpointer(directory, 4)
    assert back.restored_step == 1  # the newest complete checkpoint


@pytest.mark.torch
def test_a_sharded_checkpoint_on_a_full_disk_keeps_the_last_step(tiny_fs: Path) -> None:
    torch = pytest.importorskip("torch")
    from resilient_strategy.frameworks import sharded_checkpoint as sc

    directory = tiny_fs / "ckpt"
    small = torch.nn.Linear(4, 4)
    sc.save(directory, small, None, {"optimizer_steps": 1}, 0)
    _fill(tiny_fs, leave=4096)
    big = torch.nn.Linear(200, 200)
    with pytest.raises(NoSpaceError) as exc:
        sc.save(directory, big, None, {"optimizer_steps": 2}, 0)
    _one_line(exc.value)
    assert Path(exc.value.path).is_relative_to(directory)
    assert sc.latest(directory) == directory / "sharded" / "step-000000001"
    restored = torch.nn.Linear(4, 4)
    assert sc.load(directory, restored, None) is not None
    assert torch.equal(restored.weight, small.weight)


# ----- the supervisor, end to end ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.torch
def test_run_with_a_nearly_full_tmpdir_says_one_line(tiny_fs: Path, tmp_path: Path) -> None:
    """The issue's case: TMPDIR (where the run's files live) nearly full. Before: a raw OSError
    traceback from write_decision. Now: one line naming the file, exit 75 (infrastructure)."""
    from resilient_strategy.run.exitcodes import ExitCode

    _fill(tiny_fs, leave=8192)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tiny_fs), "CUDA_VISIBLE_DEVICES": "",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
         "--evidence-dir", str(tmp_path / "evidence"), str(ROOT / "examples" / "torch_train.py"),
         "--samples", "64", "--epochs", "1", "--global-batch-size", "32", "--hidden", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(300))
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == int(ExitCode.INFRASTRUCTURE), out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "no space left on device" in line]
    assert lines and all(str(tiny_fs) in line for line in lines), out.stderr[-3000:]
