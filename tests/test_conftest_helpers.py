"""The suite's own helpers (tests/conftest.py): a process that exits while /proc is read is
absent, never an error (the race a loaded machine hit: ``FileNotFoundError: /proc/<pid>/stat``),
and subprocess deadlines scale with the machine, never below what they were."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import MAX_SCALE, REFERENCE_CPUS, SCALE_VAR, children_of, deadline, timeout_scale


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_process_that_exits_between_the_listing_and_the_read_is_absent() -> None:
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        listing = [str(ended.pid), str(live.pid), "self", "not-a-pid"]  # as listed, both alive
        assert ended.wait(timeout=deadline(60)) == 0  # reaped: its /proc entry is gone
        assert not os.path.exists(f"/proc/{ended.pid}")
        assert children_of(os.getpid(), listing=listing) == [live.pid]
        assert live.pid in children_of(os.getpid())  # the real listing
    finally:
        live.communicate(b"", timeout=deadline(60))
    assert children_of(os.getpid(), listing=[str(live.pid)]) == []
    assert children_of(os.getpid(), root="/nonexistent") == []


def test_the_deadline_scale_follows_the_machine_and_never_shrinks() -> None:
    assert timeout_scale({}, cpus=REFERENCE_CPUS, load=0.0) == 1.0
    assert timeout_scale({}, cpus=64, load=0.0) == 1.0  # never below the deadline as written
    assert timeout_scale({}, cpus=2, load=0.0) == REFERENCE_CPUS / 2
    assert timeout_scale({}, cpus=2, load=6.0) == 4.0  # 3 runnable per core: 1 + 3
    assert timeout_scale({}, cpus=1, load=1000.0) == MAX_SCALE
    assert timeout_scale({SCALE_VAR: "3.5"}, cpus=64, load=0.0) == 3.5
    assert timeout_scale({SCALE_VAR: "0.1"}, cpus=2, load=9.0) == 1.0
    assert timeout_scale({SCALE_VAR: "many"}, cpus=2, load=0.0) == REFERENCE_CPUS / 2
    assert deadline(30) >= 30
