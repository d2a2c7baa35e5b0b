"""The runner's side of the fork server (``probing/workers/fork_server``): import torch once per decision,
fork each probe worker from it instead of starting a fresh interpreter that imports torch.

`server_for` returns a running server for (python, environment), starting one when none
is alive; `ForkServer.spawn` forks one worker and returns a `ForkedProc` that the
process runner (`probing.proc`) drives like a ``subprocess.Popen``: ``pid`` (its own session,
so ``killpg`` reaches it), ``poll``, ``wait``, ``returncode``. A server exits on its own after
``IDLE_EXIT_S`` with nothing to do, when this process dies, or at this process's exit.

Only torch is served (TensorFlow starts threads at import; forking it is not safe). Set
``RESILIENT_STRATEGY_FORKSERVER=0`` to start every worker as a fresh interpreter.

`fork_here` is the server's shortcut: where this process is fit to fork (`why_not_here`: the
caller's main thread and no other Python thread, no TensorFlow or JAX imported, no GPU driver
started here, SIGCHLD neither ignored nor handled (a script's handler that reaps every child
would take a worker's exit status: its probe would read as failed), an OpenMP pool released
first), the workers are forked from
it directly. A script that trains with torch imports it anyway, so the probe then costs no
interpreter importing torch of its own (3.4 s of a 5.6 s NCCL probe on an H200 host). The child is made what the server's child is
(`probing.workers.fork_server.become_worker`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ..process import PROCESS

#: Seconds a server waits for the next request before it exits (a decision's probes follow
#: each other within a second; the next decision starts a fresh server).
IDLE_EXIT_S = 10.0
#: Seconds a new server may take to import its framework.
START_TIMEOUT_S = 60.0
FORKSERVER_VAR = "RESILIENT_STRATEGY_FORKSERVER"
#: OpenMP's ``omp_pause_hard``: ``omp_pause_resource_all`` ends the runtime's thread pool (a child
#: forked while the pool exists hangs in its first parallel region: measured with torch's libgomp).
OMP_PAUSE_HARD = 2
#: GPU drivers that rule forking here out once started in this process (a child of a process that
#: initialised the CUDA driver cannot use CUDA) and the OpenMP runtimes whose pool is released.
CUDA_DRIVER_LIBS = ("libcuda.so", "libamdhip64.so")
OPENMP_LIBS = ("libgomp", "libiomp5", "libomp.so")
#: Frameworks that start native threads at import (TensorFlow's, as the server's docstring says;
#: JAX's runtime): a process that imported one is not forked.
THREADED_AT_IMPORT = ("tensorflow", "jax")

log = logging.getLogger("resilient_strategy")


#: The exit code a `ChildProc` gets when its status was taken by another reaper (EX_SOFTWARE):
#: the runner sees an exit, the parser reads `ChildProc.status_lost`, never this code.
LOST_STATUS = 70
#: The workers forked here whose exit status another reaper took (process-wide by nature: a
#: SIGCHLD handler or a thread of this process that waits for any child; once seen, no worker
#: is forked here again, `why_not_here`).
_LOST: list[int] = PROCESS.hold(
    "probing.forkserver.lost", list, "the workers whose exit status another reaper took")


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


class ChildProc(ForkedProc):
    """A worker forked from this process (`fork_here`): our own child, reaped here; its status
    is ``waitpid``'s, not a status file (``returncode`` negative for a signal)."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid, "")
        #: its exit status was taken by another reaper in this process (``waitpid`` answered
        #: ECHILD): ``returncode`` is then `LOST_STATUS`, which says nothing of how it ended
        self.status_lost = False

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (not by us): its code is lost
                self.returncode, self.status_lost = LOST_STATUS, True
                _LOST.append(self.pid)  # no more forking here in this process
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _mapped(maps: str = "/proc/self/maps") -> dict[str, str]:
    """Every file mapped into this process: its name -> its path."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            paths = {fields[5].strip() for line in f if len(fields := line.split(None, 5)) == 6}
    except OSError:
        return {}
    return {os.path.basename(path): path for path in paths if path.startswith("/")}


def why_not_here(maps: str = "/proc/self/maps") -> str:
    """Why this process must not fork a probe worker itself ("" when it may). It only reads; an
    OpenMP pool is released apart, by `release_openmp`, just before the fork."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "no fork on this platform"
    if threading.current_thread() is not threading.main_thread() or threading.active_count() != 1:
        return "another Python thread runs in this process (a fork copies only the caller)"
    handler = signal.getsignal(signal.SIGCHLD)
    if handler == signal.SIG_IGN:
        return "SIGCHLD is ignored here (a child's exit status would be lost)"
    if handler != signal.SIG_DFL:  # a Python handler, or one installed outside Python (None)
        return ("SIGCHLD has a handler here (one that reaps every child would take a worker's "
                "exit status)")
    if _LOST:
        return (f"a worker's exit status was taken by another reaper here (pid {_LOST[0]}): "
                "the workers are the fork server's children instead")
    why = framework_threads() or autograd_threads()
    if why:
        return why
    return driver_started(maps)


#: The name torch gives the autograd engine's device threads (``pt_autograd_<device>``): started
#: by the first backward pass on a build with an accelerator, even for CPU tensors, and fatal to
#: a forked child's autograd ("Unable to handle autograd's threading in combination with
#: fork-based multiprocessing", https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork).
AUTOGRAD_THREAD = "pt_autograd"


def autograd_threads(tasks: str = "/proc/self/task") -> str:
    """Why autograd rules forking here out ("" when its device threads never started in this
    process, or the threads cannot be listed): read from each thread's name."""
    try:
        names = os.listdir(tasks)
    except OSError:
        return ""
    for tid in names:
        try:
            with open(os.path.join(tasks, tid, "comm"), encoding="utf-8",
                      errors="replace") as f:
                name = f.read(64).strip()
        except OSError:
            continue  # a thread that ended between the listing and the read
        if name.startswith(AUTOGRAD_THREAD):
            return ("autograd's device threads run here (a backward pass ran before the "
                    "decision): a forked child could not use autograd")
    return ""


def framework_threads() -> str:
    """Why a framework imported here rules forking out ("" when none is): TensorFlow and JAX
    start native threads at import, which the Python thread count does not show."""
    threaded = [name for name in THREADED_AT_IMPORT if name in sys.modules]
    return f"{threaded[0]} is imported here (it starts threads of its own)" if threaded else ""


def driver_started(maps: str = "/proc/self/maps") -> str:
    """Why a GPU driver rules forking here out ("" when none was started in this process, or
    none is loaded): read from the process's mappings, then asked (`_driver_started`)."""
    loaded = _mapped(maps)
    if not loaded:
        return "this process's mappings cannot be read"
    for name, path in sorted(loaded.items()):
        if name.startswith(CUDA_DRIVER_LIBS) and _driver_started(name, path):
            return f"the GPU driver was started here ({name}): a forked child cannot use it"
    return ""


#: ``CUDA_ERROR_NOT_INITIALIZED``: what every driver call but ``cuInit`` answers before it.
CUDA_NOT_INITIALIZED = 3


def _driver_started(name: str, path: str) -> bool:
    """Whether this process initialised the GPU driver it loaded (``import torch`` of a CUDA
    build loads ``libcuda`` without initialising it; ``torch.cuda.is_available()`` and any CUDA
    work initialise it). ``cuCtxGetCurrent`` answers `CUDA_NOT_INITIALIZED` before ``cuInit``
    and initialises nothing; anything else, or a driver that cannot be asked, counts as started."""
    if not name.startswith("libcuda.so"):
        return True  # ROCm: not asked (ROCm GPUs are not probed, see machine/versions)
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
        current = lib.cuCtxGetCurrent
    except (OSError, AttributeError):
        return True
    ctx = ctypes.c_void_p()
    current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    current.restype = ctypes.c_int
    return bool(current(ctypes.byref(ctx)) != CUDA_NOT_INITIALIZED)


def release_openmp(maps: str = "/proc/self/maps") -> str:
    """End the thread pool of every OpenMP runtime loaded here (it is started again by the next
    parallel region); "" when none is loaded or each released, else why one was not."""
    for name, path in sorted(_mapped(maps).items()):
        if not name.startswith(OPENMP_LIBS):
            continue
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))  # the loaded one, as is
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError) as exc:
            return f"{name}'s thread pool cannot be released: {exc}"
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        if pause(OMP_PAUSE_HARD) != 0:
            return f"{name} refused to release its thread pool"
    return ""


def fork_here(module: str, argv: list[str], env: Mapping[str, str], cwd: str, stdout: str,
              stderr: str) -> ChildProc:
    """Fork one worker from this process (torch and the worker module imported here first, as the
    server imports them). Raises `ForkServerError` when this process is not fit (`why_not_here`),
    so that the caller uses the server instead."""
    from .workers.fork_server import PRELOAD, fork_worker

    why = why_not_here()
    if not why:
        try:
            for name in PRELOAD["torch"]:
                importlib.import_module(name)
        except Exception as exc:  # a broken install: the server or a fresh process says why
            why = f"torch does not import here: {type(exc).__name__}: {exc}"
    why = why or why_not_here() or release_openmp()  # importing may have started a thread
    if why:
        raise ForkServerError(why)
    for stream in (sys.stdout, sys.stderr):  # or the child writes our buffered text again
        with contextlib.suppress(Exception):
            stream.flush()
    req = {"module": module, "argv": argv, "env": dict(env), "cwd": cwd, "stdout": stdout,
           "stderr": stderr}
    pid = fork_worker(req)
    return ChildProc(pid)


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
FORK_SERVERS = PROCESS.hold("probing.forkserver.servers", ForkServers,
                            "the fork servers this process started")
atexit.register(FORK_SERVERS.close_all)


def server_for(python: str, env: Mapping[str, str]) -> ForkServer:
    """A live torch fork server for this interpreter and environment, from `FORK_SERVERS`."""
    return FORK_SERVERS.server_for(python, env)


def close_all() -> None:
    """Stop every server this process started."""
    FORK_SERVERS.close_all()
