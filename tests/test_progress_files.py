"""Progress files that cannot hurt (issue 22.4): allocated up front (a full disk is a typed error
before training, never a SIGBUS), FIFOs refused without blocking, and one rank's "finished"
ends stall detection for that rank only."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from resilient_strategy.errors import NoSpaceError
from resilient_strategy.records.progress import (
    COMM_READY,
    COMM_SETUP,
    DEVICE_READY,
    FINISHED,
    IMPORTED,
    ProgressWriter,
    read_record,
)
from resilient_strategy.run.watch import TrainingWatch

fifo_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def test_the_progress_file_has_its_blocks_before_the_first_record(tmp_path: Path) -> None:
    path = tmp_path / "rank0.progress"
    w = ProgressWriter(str(path))
    st = os.stat(path)
    assert st.st_size == 128 and st.st_blocks > 0  # allocated, not a hole
    assert read_record(str(path)) is not None
    w.close()


def test_a_full_disk_is_a_typed_error_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "rank0.progress"
    with pytest.raises(NoSpaceError) as exc:
        ProgressWriter(str(path))
    assert exc.value.path == str(path)


def test_a_filesystem_without_fallocate_gets_zeros(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    w = ProgressWriter(str(tmp_path / "p"))
    assert w.enabled and read_record(str(tmp_path / "p")) is not None
    w.close()


def _returns_within(fn: object, seconds: float = 5.0) -> bool:
    t = threading.Thread(target=fn, daemon=True)  # type: ignore[arg-type]
    t.start()
    t.join(seconds)
    return not t.is_alive()


@fifo_only
def test_a_fifo_in_place_of_a_progress_file_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "rank0.progress"
    os.mkfifo(fifo)
    got: list[object] = []
    assert _returns_within(lambda: got.append(read_record(str(fifo))))
    assert got == [None]
    writers: list[ProgressWriter] = []
    assert _returns_within(lambda: writers.append(ProgressWriter(str(fifo))))
    assert not writers[0].enabled  # refused: no record goes into a pipe


def test_the_writer_never_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x")
    link = tmp_path / "rank0.progress"
    link.symlink_to(target)
    assert not ProgressWriter(str(link)).enabled
    assert target.read_bytes() == b"x"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_ranks_finished_does_not_end_stall_detection_for_the_others(tmp_path: Path) -> None:
    clock = Clock()
    paths = [str(tmp_path / f"rank{r}.progress") for r in range(2)]
    watch = TrainingWatch(paths, 60.0, clock)
    writers = [ProgressWriter(p, clock=clock) for p in paths]
    for w in writers:
        for phase in (IMPORTED, DEVICE_READY, COMM_SETUP, COMM_READY):
            w.phase(phase)
    for w in writers:
        w.enter(1)
        w.leave(1)
    writers[0].phase(FINISHED, 1)  # rank 0 is done (uneven data: a bug of the script)
    writers[1].enter(2)  # rank 1 waits in a collective rank 0 will never join
    assert watch.poll() is None
    clock.t += 61.0
    stall = watch.poll()
    assert stall is not None and stall.ranks == (0,) and stall.kind == "straggler"


def test_every_rank_finished_is_never_a_stall(tmp_path: Path) -> None:
    clock = Clock()
    paths = [str(tmp_path / f"rank{r}.progress") for r in range(2)]
    watch = TrainingWatch(paths, 60.0, clock)
    writers = [ProgressWriter(p, clock=clock) for p in paths]
    for w in writers:
        for phase in (IMPORTED, DEVICE_READY, COMM_SETUP, COMM_READY):
            w.phase(phase)
        w.enter(1)
    assert watch.poll() is None
    for w in writers:
        w.leave(1)
        w.phase(FINISHED, 1)
    clock.t += 600.0
    assert watch.poll() is None
