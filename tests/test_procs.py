"""A process seen from outside: /proc/<pid>/stat and environ parsed from strings; the thin
readers on real processes (a child stopped with a real SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import deadline

from resilient_strategy.machine.procs import (
    alive,
    could_be_pid,
    parse_environ,
    parse_stat,
    pids_with_env,
    read_stat,
)

#: proc(5) lines: the command may hold spaces and parentheses (the last ")" ends it).
RUNNING = ("4242 (python) R 1 4242 4242 0 -1 4194304 1000 0 0 0 "
           "250 40 0 0 20 0 3 0 12345 1000000 5000 18446744073709551615")
STOPPED = ("77 (a (weird) name) T 1 77 77 0 -1 4194304 10 0 0 0 "
           "7 3 0 0 20 0 1 0 1 1 1 1")


@pytest.mark.parametrize("text,want", [
    (RUNNING, (4242, "R", 290, False)),
    (STOPPED, (77, "T", 10, True)),
    (STOPPED.replace(" T ", " t "), (77, "t", 10, True)),
    (RUNNING.replace(" R ", " D "), (4242, "D", 290, False)),
])
def test_stat_lines_give_the_state_and_the_cpu_ticks(
        text: str, want: tuple[int, str, int, bool]) -> None:
    got = parse_stat(text)
    assert got is not None and (got.pid, got.state, got.cpu_ticks, got.stopped) == want
    assert got.uninterruptible is (want[1] == "D")


@pytest.mark.parametrize("text", ["", "garbage", "12 (x) R 1 2", "x (y) R " + "1 " * 20,
                                  "12 (x) RR " + "1 " * 20, "12 (x) R " + "a " * 20])
def test_anything_else_is_not_a_stat(text: str) -> None:
    assert parse_stat(text) is None


def test_environ_is_nul_separated_pairs() -> None:
    assert parse_environ(b"A=1\0RANK=0\0EMPTY=\0junk\0=x\0B=a=b\0") == {
        "A": "1", "RANK": "0", "EMPTY": "", "B": "a=b"}


def test_a_real_child_is_found_by_its_environment_and_seen_stopped() -> None:
    tag = uuid.uuid4().hex
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "RS_TEST_TAG": tag, "RANK": "1"})
    try:
        until = time.monotonic() + deadline(10)
        while pids_with_env({"RS_TEST_TAG": tag}) != [child.pid] and time.monotonic() < until:
            time.sleep(0.01)
        assert pids_with_env({"RS_TEST_TAG": tag, "RANK": "1"}) == [child.pid]
        assert pids_with_env({"RS_TEST_TAG": tag, "RANK": "0"}) == []
        before = read_stat(child.pid)
        assert before is not None and not before.stopped
        os.kill(child.pid, signal.SIGSTOP)
        until = time.monotonic() + deadline(10)
        while not (st := read_stat(child.pid)) or not st.stopped:
            assert time.monotonic() < until
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait(timeout=deadline(10))
    assert read_stat(child.pid) is None  # reaped: gone
    assert read_stat(os.getpid()) is not None


def test_alive_is_true_of_this_process_and_false_of_numbers_no_process_has() -> None:
    assert alive(os.getpid()) and could_be_pid(os.getpid())
    for pid in (0, -1, -os.getpid(), 1 << 31, 10 ** 30):  # 0 and -n would signal a group
        assert not could_be_pid(pid) and not alive(pid)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=deadline(60))  # reaped: its pid names no process
    assert not alive(child.pid)
