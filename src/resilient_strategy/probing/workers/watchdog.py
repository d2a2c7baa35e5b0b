"""Worker-side protection against orphaning: die when the process that started us dies.

The runner kills its workers on every path it controls; this covers the one it does not (the
parent itself SIGKILLed). Call `watch_parent` before importing any framework.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from ...machine.procs import alive

_PR_SET_PDEATHSIG = 1
EXIT_PARENT_GONE = 3


def die_with_parent(expected_parent: int | None = None) -> int:
    """SIGKILL this process when its parent dies (Linux), and exit (code 3) at once if the
    parent already changed; returns the parent's pid. Starts no thread."""
    parent = os.getppid() if expected_parent is None else expected_parent
    if sys.platform.startswith("linux"):
        try:  # fires when the parent *thread* that forked us exits; harmless: it waits for us
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(EXIT_PARENT_GONE)
    return parent


def watch_parent(expected_parent: int | None = None, interval_s: float = 0.2) -> None:
    """Exit (code 3) as soon as the parent changes; ``expected_parent`` defaults to the current one.

    Passing the parent's pid closes the race where the parent died before this call.
    """
    parent = die_with_parent(expected_parent)

    def check() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=check, name="rs-parent-watchdog", daemon=True).start()


def watch_process(pid: int, interval_s: float = 0.2) -> None:
    """Exit (code 3) as soon as process ``pid`` (not necessarily the parent) ends: a daemon
    thread waits on its pidfd where the OS has one (Linux >= 5.3: readable once it ends, a
    zombie too), else polls ``kill(pid, 0)``. A process already gone exits at once."""
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is None and not alive(pid):
        os._exit(EXIT_PARENT_GONE)

    def check() -> None:
        if fd is not None:
            import select

            while not select.select([fd], [], [], interval_s * 25)[0]:
                pass
            os._exit(EXIT_PARENT_GONE)
        while alive(pid):
            time.sleep(interval_s)
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=check, name="rs-supervisor-watchdog", daemon=True).start()

