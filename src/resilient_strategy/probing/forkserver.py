"""The runner's side of the fork server (``probing/workers/fork_server``): import torch once per decision,
fork each probe worker from it instead of starting a fresh interpreter that imports torch.

`server_for` returns a running server for (python, environment), starting one when none
is alive; `ForkServer.spawn` forks one worker and returns a `ForkedProc` that the
process runner (`probing.proc`) drives like a ``subprocess.Popen``: ``pid`` (its own session,
so ``killpg`` reaches it), ``poll``, ``wait``, ``returncode``. A server exits on its own after
``IDLE_EXIT_S`` with nothing to do, when this process dies, or at this process's exit.

Only torch is served (TensorFlow starts threads at import; forking it is not safe). Set
``RESILIENT_STRATEGY_FORKSERVER=0`` to start every worker as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

#: Seconds a server waits for the next request before it exits (a decision's probes follow
#: each other within a second; the next decision starts a fresh server).
IDLE_EXIT_S = 10.0
#: Seconds a new server may take to import its framework.
START_TIMEOUT_S = 60.0
FORKSERVER_VAR = "RESILIENT_STRATEGY_FORKSERVER"



class ForkServerError(OSError):
    """The fork server could not start or answer (the caller falls back to fresh processes)."""


class ForkedProc:
    """A worker forked by the server, driven like ``subprocess.Popen``."""

    def __init__(self, pid: int, status_path: str) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status = status_path

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                text = Path(self._status).read_text(encoding="ascii").strip()
            except OSError:
                return None
            if text:
                self.returncode = int(text)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """One running server process (its own session)."""

    def __init__(self, python: str, env: Mapping[str, str], framework: str = "torch") -> None:
        self.proc = subprocess.Popen(
            [python, "-m", "resilient_strategy.probing.workers.fork_server", "--framework", framework,
             "--parent-pid", str(os.getpid()), "--idle-exit", f"{IDLE_EXIT_S:g}"],
            env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True, cwd="/",
        )
        self._seq = 0
        try:
            self._read(START_TIMEOUT_S)  # {"ready": pid} once the framework is imported
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout_s: float) -> dict[str, object]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        line = b""
        end = time.monotonic() + timeout_s
        while not line.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ForkServerError("the fork server did not answer in time")
            chunk = os.read(fd, 1)
            if not chunk:
                raise ForkServerError("the fork server exited")
            line += chunk
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ForkServerError(f"unexpected answer from the fork server: {line!r}")
        return data

    def spawn(self, module: str, argv: list[str], env: Mapping[str, str], cwd: str,
              stdout: str, stderr: str) -> ForkedProc:
        assert self.proc.stdin is not None
        self._seq += 1
        status = f"{stdout}.status"
        req = {"module": module, "argv": argv, "env": dict(env), "cwd": cwd, "stdout": stdout,
               "stderr": stderr, "status": status}
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise ForkServerError(f"the fork server is gone: {exc}") from exc
        pid = self._read(10.0).get("pid")
        if not isinstance(pid, int):
            raise ForkServerError(f"the fork server did not fork: {pid!r}")
        return ForkedProc(pid, status)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2.0)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def enabled(env: Mapping[str, str]) -> bool:
    return (env.get(FORKSERVER_VAR, "1").strip().lower() not in ("0", "false")
            and hasattr(os, "fork"))


class ForkServers:
    """The fork servers one holder started, by interpreter and environment. The prober uses this
    process's instance (`FORK_SERVERS`, closed at exit); a test may hold its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.servers: dict[tuple[str, tuple[tuple[str, str], ...]], ForkServer] = {}

    def server_for(self, python: str, env: Mapping[str, str]) -> ForkServer:
        """A live torch fork server for this interpreter and environment (started when needed)."""
        key = (python, tuple(sorted(env.items())))
        with self.lock:
            for k, old in list(self.servers.items()):  # reap the ones that exited while idle
                if k != key and not old.alive:
                    old.close()
                    del self.servers[k]
            server = self.servers.get(key)
            if server is not None and server.alive:
                return server
            if server is not None:
                server.close()
            server = ForkServer(python, env)
            self.servers[key] = server
            return server

    def close_all(self) -> None:
        """Stop every server this holder started."""
        with self.lock:
            for server in self.servers.values():
                server.close()
            self.servers.clear()


#: This process's fork servers.
FORK_SERVERS = ForkServers()
atexit.register(FORK_SERVERS.close_all)


def server_for(python: str, env: Mapping[str, str]) -> ForkServer:
    """A live torch fork server for this interpreter and environment, from `FORK_SERVERS`."""
    return FORK_SERVERS.server_for(python, env)


def close_all() -> None:
    """Stop every server this process started."""
    FORK_SERVERS.close_all()
