"""How a probe worker starts: `Starter`, the one entry point, with two ways.

- Forked from this process (`fork_here`) where it is fit (`why_not_here`: the caller's main
  thread and no other Python thread, no TensorFlow or JAX imported, no GPU driver started here,
  no autograd device thread, SIGCHLD neither ignored nor handled (a script's handler that reaps
  every child would take a worker's exit status: its probe would read as failed), no worker's
  status lost before), an OpenMP pool released first (`release_openmp`). A script that trains
  with torch imports it anyway, so the probe then costs no interpreter importing torch of its
  own (3.4 s of a 5.6 s NCCL probe on an H200 host). The child is a `ChildProc`: its own
  session (so ``killpg`` reaches it), reaped here, driven like a ``subprocess.Popen``.
- Else a fresh interpreter (`probing.proc.start_fresh`): TensorFlow (it starts threads at
  import: forking it is not safe), another interpreter than this one, a process unfit to fork,
  or ``RESILIENT_STRATEGY_FORKSERVER=0``.

(A server process that imported torch once and forked the workers of a process unfit to fork
saved 0.2 s a cold decision on 2 cores by 2026-12-02: it is gone; see ARCHITECTURE.md.)
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

from ..process import PROCESS
from .proc import Proc, WorkerCommand, start_fresh

FORKSERVER_VAR = "RESILIENT_STRATEGY_FORKSERVER"
#: OpenMP's ``omp_pause_hard``: ``omp_pause_resource_all`` ends the runtime's thread pool (a child
#: forked while the pool exists hangs in its first parallel region: measured with torch's libgomp).
OMP_PAUSE_HARD = 2
#: GPU drivers that rule forking here out once started in this process (a child of a process that
#: initialised the CUDA driver cannot use CUDA) and the OpenMP runtimes whose pool is released.
CUDA_DRIVER_LIBS = ("libcuda.so", "libamdhip64.so")
OPENMP_LIBS = ("libgomp", "libiomp5", "libomp.so")
#: Frameworks that start native threads at import (TensorFlow's, JAX's
#: runtime): a process that imported one is not forked.
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


class ForkRefused(OSError):
    """This process is not fit to fork a worker (`why_not_here`): the worker starts fresh."""


class ChildProc:
    """A worker forked from this process (`fork_here`), driven like ``subprocess.Popen``: our own
    child, reaped here; its status is ``waitpid``'s (``returncode`` negative for a signal)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
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

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
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
                "the workers start as fresh interpreters instead")
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


#: What this process imports before it forks a torch worker: torch and what every worker imports
#: next (a training script has most of it imported already).
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel",
           "resilient_strategy.probing.workers.torch_worker")


def become_worker(req: dict[str, Any], ready_w: int) -> None:
    """In the forked child: become the worker the request describes. Never returns."""
    code = 70
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # a handler of the forking process is not ours
        os.write(ready_w, b"1")
        os.close(ready_w)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # the forking process's streams may not be its fds (a test's capture, a notebook's)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = [str(a) for a in req["argv"]]
        if "--parent-pid" in argv:  # the watchdog watches the process that forked us
            argv[argv.index("--parent-pid") + 1] = str(os.getppid())
        sys.argv = [req["module"], *argv]
        module = importlib.import_module(req["module"])
        module.main(argv)  # probe workers end with os._exit
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"forked worker: {type(exc).__name__}: {exc}\n".encode())
        code = 70
    finally:
        os._exit(code)


def fork_worker(req: dict[str, Any]) -> int:
    """Fork the worker ``req`` describes (`become_worker`) and return its pid once it has its
    own session (so that the runner's ``killpg`` reaches it)."""
    ready_r, ready_w = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns of any native thread (torch's CUDA build starts some at import);
        # `why_not_here` checked what matters: no other Python thread, no GPU driver started
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child ends in os._exit
        os.close(ready_r)
        become_worker(req, ready_w)
    os.close(ready_w)
    with contextlib.suppress(OSError):
        os.read(ready_r, 1)  # the child has its own session now
    os.close(ready_r)
    return pid


def fork_here(module: str, argv: list[str], env: Mapping[str, str], cwd: str, stdout: str,
              stderr: str) -> ChildProc:
    """Fork one worker from this process (torch and the worker module imported here first).
    Raises `ForkRefused` when this process is not fit (`why_not_here`), so that the caller starts
    a fresh interpreter instead."""
    why = why_not_here()
    if not why:
        try:
            for name in PRELOAD:
                importlib.import_module(name)
        except Exception as exc:  # a broken install: a fresh process says why
            why = f"torch does not import here: {type(exc).__name__}: {exc}"
    why = why or why_not_here() or release_openmp()  # importing may have started a thread
    if why:
        raise ForkRefused(why)
    for stream in (sys.stdout, sys.stderr):  # or the child writes our buffered text again
        with contextlib.suppress(Exception):
            stream.flush()
    req = {"module": module, "argv": argv, "env": dict(env), "cwd": cwd, "stdout": stdout,
           "stderr": stderr}
    pid = fork_worker(req)
    return ChildProc(pid)


def enabled(env: Mapping[str, str]) -> bool:
    """Whether forking here may be tried at all (``RESILIENT_STRATEGY_FORKSERVER=0``: never)."""
    return (env.get(FORKSERVER_VAR, "1").strip().lower() not in ("0", "false")
            and hasattr(os, "fork"))


def forks_here(framework: str, env: Mapping[str, str], python: str = sys.executable) -> bool:
    """Whether `Starter` would fork this framework's workers here now (for a cost estimate)."""
    return (framework == "torch" and python == sys.executable and enabled(env)
            and not why_not_here())


class Starter:
    """The one way a probe worker starts (a `probing.proc.Spawn`): forked from this process where
    it is fit (`fork_here`: torch only, this interpreter, switched on), else a fresh interpreter
    (`probing.proc.start_fresh`). Once refused, the probe's other workers start fresh too."""

    def __init__(self, framework: str, env: Mapping[str, str],
                 python: str = sys.executable) -> None:
        self.python = python
        self.fork = framework == "torch" and python == sys.executable and enabled(env)
        #: why forking here was refused ("" while it was not)
        self.refused = ""

    def __call__(self, cmd: WorkerCommand, stdout: str, stderr: str) -> Proc:
        argv = list(cmd.argv)
        if self.fork and not self.refused and argv[:2] == [self.python, "-m"]:
            try:  # this process imports torch once (the script trains with it) and forks
                return fork_here(argv[2], argv[3:], cmd.env, cmd.cwd, stdout, stderr)
            except ForkRefused as exc:
                self.refused = str(exc)
                log.debug("probe workers start as fresh interpreters: %s", exc)
        return start_fresh(cmd, stdout, stderr)
