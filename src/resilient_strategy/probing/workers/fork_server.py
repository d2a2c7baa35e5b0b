"""Fork server: import a framework once, then fork one probe worker per request.

    python -m resilient_strategy.probing.workers.fork_server --framework torch --parent-pid PID \\
        [--idle-exit S]

Started by `resilient_strategy.probing.forkserver`. After ``import torch`` (which initializes no
CUDA context: a forked child may still choose its GPUs, set CUDA_VISIBLE_DEVICES and NCCL_*),
it reads one JSON request per line on stdin::

    {"module": "resilient_strategy.probing.workers.torch_worker", "argv": [...], "env": {...},
     "cwd": "...", "stdout": PATH, "stderr": PATH, "status": PATH}

and forks a child that starts its own session (so the runner can kill its process group),
points fds 0/1/2 at /dev/null and the two files, takes ``env`` as its whole environment and
``cwd``, and runs the module's ``main(argv)``. The server answers ``{"pid": N}`` once the
child's session exists, reaps its children and writes each one's exit status (as
``Popen.returncode`` would be: negative for a signal) to its ``status`` file. It exits when
stdin closes, when its parent dies, or after ``--idle-exit`` seconds with nothing running.

TensorFlow is never pre-imported: it starts threads at import, and forking a threaded process
is not safe.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import select
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from ...errors import NoSpaceError
from ...machine import files
from .watchdog import EXIT_PARENT_GONE, die_with_parent

#: What the server imports before it forks: the framework and what every worker imports next.
PRELOAD = {"torch": ("torch", "torch.distributed", "torch.nn.parallel",
                     "resilient_strategy.probing.workers.torch_worker")}


def become_worker(req: dict[str, Any], ready_w: int) -> None:
    """In the forked child (of this server, or of the decision's own process): become the worker
    the request describes. Never returns."""
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
        if "--parent-pid" in argv:  # our parent is this server now, not the runner
            argv[argv.index("--parent-pid") + 1] = str(os.getppid())
        sys.argv = [req["module"], *argv]
        module = importlib.import_module(req["module"])
        module.main(argv)  # probe workers end with os._exit
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"fork server child: {type(exc).__name__}: {exc}\n".encode())
        code = 70
    finally:
        os._exit(code)


def fork_worker(req: dict[str, Any]) -> int:
    """Fork the worker ``req`` describes (`become_worker`) and return its pid once it has its
    own session (so that the runner's ``killpg`` reaches it)."""
    ready_r, ready_w = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns of any native thread (torch's CUDA build starts some at import);
        # whoever forks here checked what matters: no other Python thread, no GPU driver started
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


def _write_status(path: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with contextlib.suppress(OSError, NoSpaceError):
        files.write_bytes_atomic(path, str(code).encode("ascii"), durable=False,
                                 what="a probe worker's exit status")


def serve(idle_exit_s: float, parent: int) -> None:
    children: dict[int, str] = {}  # pid -> status path
    buf = b""
    idle_since = time.monotonic()
    stdin = sys.stdin.buffer.fileno()
    while True:
        if os.getppid() != parent:  # no watchdog thread here: forking a threaded process is unsafe
            os._exit(EXIT_PARENT_GONE)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            path = children.pop(pid, None)
            if path:
                _write_status(path, status)
            idle_since = time.monotonic()
        if not children and time.monotonic() - idle_since > idle_exit_s:
            return
        ready, _, _ = select.select([stdin], [], [], 0.02)
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:  # the runner closed us: finish reaping, then leave
            for pid, path in list(children.items()):
                with contextlib.suppress(ChildProcessError):
                    _, status = os.waitpid(pid, 0)
                    _write_status(path, status)
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = fork_worker(req)
            children[pid] = req["status"]
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()
            idle_since = time.monotonic()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m resilient_strategy.probing.workers.fork_server")
    p.add_argument("--framework", choices=["torch"], required=True)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--idle-exit", type=float, default=10.0)
    args = p.parse_args(argv)
    parent = die_with_parent(args.parent_pid)
    for name in PRELOAD[args.framework]:
        importlib.import_module(name)
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    serve(args.idle_exit, parent)
    # Every answer was flushed and every child reaped: leave without the interpreter's teardown
    # (with torch imported it took ~1 s, which the runner's close waited for after each decision).
    os._exit(0)


if __name__ == "__main__":
    main()
