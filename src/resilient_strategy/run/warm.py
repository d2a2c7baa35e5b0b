"""A warm start for ``resilient-strategy run``'s workers (on by default; ``--no-warm-start``
or ``RESILIENT_STRATEGY_WARM_START=0`` turns it off): every rank of every attempt is forked
from one server that imported torch (and this package's worker) once, instead of a fresh
interpreter that imports them again, so a relaunch does not pay for torch again.

The server is multiprocessing's ``forkserver`` with `PRELOAD` (`start_server`); torch's
elastic agent starts a function entry point (`resilient_strategy.run.worker.warm_main`) through
it (``torch.multiprocessing.start_processes`` with the ``forkserver`` start method). Importing
torch initializes no CUDA (the child checks ``torch.cuda.is_initialized()``), and CUDA and NCCL
start in each child, after its environment is set. The server starts once, before the first
attempt's agent, with the supervisor's environment as it is then, and lives as long as the
supervisor: multiprocessing ends it when the supervisor's end of its pipe closes, once its
imports are done; a SIGKILLed supervisor ends it at once, also while it is still importing
torch (`die_with_supervisor`, the first thing the server runs: ``PR_SET_PDEATHSIG`` on Linux,
and an exit when the supervisor was gone already); each child dies with it
(``PR_SET_PDEATHSIG``) and with the supervisor (a watch on its pid).

What a child must be, and how:

- Its environment is exactly what a fresh worker would get (`worker_environment`): the
  supervisor's ``os.environ`` when the attempt's workers start, then every variable the agent
  set for this rank. Variables read when torch is imported (``OMP_NUM_THREADS`` through
  libgomp's load-time constructor) were read in the server: `match_threads` sets torch's
  thread count from the child's own environment.
- Its exit code is the script's (``sys.exit(3)``: 3; an exception: its error record, 1;
  ``SIGKILL``: -9), and the agent sees it through the server's report.
- Found from outside by the pid it writes to its run directory (`rank_pids`), since
  ``/proc/<pid>/environ`` of a forked child shows the server's environment.

Only torch jobs start warm (`applies`): a TensorFlow script must not find torch imported.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..machine.procs import alive
from ..process import PROCESS
from ..records.rundir import RUN_PREFIX

#: The start method of a warm start (torchrun's ``--start-method``).
START_METHOD = "forkserver"

#: What the server imports before it forks, in order: this module first (it notes the
#: environment the server started with, `SERVER_ENV`), the worker and what it imports next, then
#: torch, the agent's own wrapper of a function entry point (every child unpickles it), and what
#: every training script imports next (``torch._dynamo``: building an optimizer imports it,
#: 1-2 s). None of them initializes CUDA or starts a thread.
PRELOAD = (
    "resilient_strategy.run.warm",
    "resilient_strategy.run.worker",
    "resilient_strategy.deciding.executor",
    "resilient_strategy.selection",
    "resilient_strategy.frameworks.torch",
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing",
    "torch.nn.parallel",
    "torch._dynamo",
)

#: This process's environment when this module was first imported: in the fork server, the
#: environment it started with, before any of `PRELOAD` was imported.
SERVER_ENV: dict[str, str] = dict(os.environ)

_STARTED: list[bool] = PROCESS.hold(
    "run.warm.started", list, "whether the warm start's fork server was started")

#: How multiprocessing starts its fork server (``python -c`` with this command, Python
#: 3.10-3.13): the numbers are the listening socket's descriptor and the read end of the pipe
#: whose write end only the processes that use the server hold (the supervisor).
_SERVER_COMMAND = re.compile(
    r"from multiprocessing\.forkserver import main; main\((\d+), (\d+)\b")


def server_alive_fd(orig_argv: Sequence[str]) -> int | None:
    """In the fork server (its command line, ``sys.orig_argv``): the read end of the pipe that
    reads end-of-file once the supervisor is gone; anywhere else None (pure)."""
    args = list(orig_argv)  # [python, *interpreter flags, "-c", command]: multiprocessing's
    if len(args) < 3 or args[-2] != "-c" or "-m" in args[1:-2]:
        return None
    found = _SERVER_COMMAND.match(args[-1])
    return int(found.group(2)) if found else None


def die_with_supervisor(orig_argv: Sequence[str] | None = None) -> bool:
    """In the fork server (`server_alive_fd`), before it imports torch: be SIGKILLed when the
    supervisor dies (``PR_SET_PDEATHSIG``; the supervisor's main thread started it), and exit
    at once when it has died already (its pipe reads end-of-file). multiprocessing's own
    watch of the pipe begins only once every module of `PRELOAD` is imported: seconds of torch
    (12.7 s seen on a loaded machine), during which the server outlived its supervisor.
    Returns whether this process is the server; nothing happens elsewhere."""
    import select
    import stat

    fd = server_alive_fd(sys.orig_argv if orig_argv is None else orig_argv)
    if fd is None:
        return False
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
    except OSError:
        return False
    from ..probing.workers.watchdog import EXIT_PARENT_GONE, die_with_parent

    die_with_parent()
    with contextlib.suppress(OSError, ValueError):
        if select.select([fd], [], [], 0)[0]:  # every writer gone: the supervisor is
            os._exit(EXIT_PARENT_GONE)
    return True


die_with_supervisor()  # this module is the first of `PRELOAD`: the server runs this first


def applies(framework: str, platform: str = sys.platform) -> bool:
    """Whether a job of ``framework`` can start warm here: torch, on an OS with ``fork``
    (multiprocessing's forkserver)."""
    return framework == "torch" and not platform.startswith("win")


def start_server(temp_dir: Path | None = None) -> None:
    """Start this process's fork server with `PRELOAD` (once; later calls do nothing). It
    takes this process's environment as it is now: call it before an attempt sets its own
    variables. Returns at once: the server imports torch while this process goes on, and the
    first fork waits for it. ``temp_dir``: where multiprocessing keeps its files (the server's
    socket), created private and removed at this process's exit, unless multiprocessing has a
    directory already; where the socket's path would be too long there (`socket_dirs`), the
    same name in /tmp; named so
    that the supervisor's sweep knows it, a SIGKILLed supervisor's is removed by the next run
    (multiprocessing's own ``pymp-*`` directory would be left behind)."""
    if _STARTED:
        return
    import multiprocessing
    from multiprocessing import forkserver

    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    if temp_dir is not None and config.get("tempdir") is None:
        made = next((d for d in socket_dirs(temp_dir) if _private_dir(d)), None)
        if made is None:  # each name too long, or taken (another user's): a fresh random one
            made = _fresh_dir(temp_dir.name)
        if made is not None:
            import atexit
            import shutil

            atexit.register(shutil.rmtree, str(made), True)
            config["tempdir"] = str(made)  # what multiprocessing.util.get_temp_dir() returns
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    _STARTED.append(True)
    import atexit

    atexit.register(stop_server)


#: The longest a stop waits for the server to end (it ends at once, or once its imports are
#: done when it is still importing) before it is killed.
STOP_WAIT_S = 10.0


def stop_server(wait_s: float = STOP_WAIT_S) -> None:
    """End this process's fork server now and reap it (at this process's exit: so that nothing
    of the run is left running once it has exited): its pipe closed, ``wait_s`` at most, then
    SIGKILL. Never raises; nothing to do without a server."""
    import signal
    import time
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid, fd = (getattr(server, "_forkserver_pid", None),
               getattr(server, "_forkserver_alive_fd", None))
    if not isinstance(pid, int):
        return
    with contextlib.suppress(OSError, TypeError):
        os.close(fd)  # type: ignore[arg-type]  # the server reads EOF: it exits
    end = time.monotonic() + wait_s
    with contextlib.suppress(OSError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= end:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    with contextlib.suppress(AttributeError):
        server._forkserver_pid = server._forkserver_alive_fd = None  # type: ignore[union-attr]


#: The longest path of a unix socket (``sun_path``, less its NUL), and the length of the name
#: multiprocessing gives the server's socket in its directory (``/listener-XXXXXXXX``).
MAX_SOCKET_PATH = 107
SOCKET_NAME_CHARS = 18


def socket_dirs(temp_dir: Path, fallback: Path = Path("/tmp")) -> tuple[Path, ...]:
    """Where the server's socket may go, in order (pure): ``temp_dir``, then the same name in
    ``fallback``, each only where the socket's path fits `MAX_SOCKET_PATH` (a long TMPDIR);
    none: multiprocessing keeps its own directory."""
    return tuple(d for d in (temp_dir, fallback / temp_dir.name)
                 if len(str(d)) + SOCKET_NAME_CHARS <= MAX_SOCKET_PATH)


def _fresh_dir(name: str, fallback: Path = Path("/tmp")) -> Path | None:
    """A fresh private directory ``<fallback>/<name>-<random>`` for the server's socket, where
    every fixed name was too long or taken (another user squatting ``rs-run-<pid>-m``): a random
    name cannot be planted in advance, and the sweep still reads the pid from it. None where it
    cannot be made or its socket's path would still be too long (multiprocessing keeps its own
    directory, inside the session's private ``torch-tmp``)."""
    import shutil
    import tempfile

    try:
        made = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=fallback))
    except OSError:
        return None
    if len(str(made)) + SOCKET_NAME_CHARS <= MAX_SOCKET_PATH:
        return made
    shutil.rmtree(made, ignore_errors=True)
    return None


def _private_dir(path: Path) -> bool:
    """Make ``path`` a fresh private directory for the server's socket; False (the caller keeps
    multiprocessing's own) when it cannot be made. One left by an earlier process with this
    name (this process's pid) is removed first."""
    import shutil
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    else:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        shutil.rmtree(path, ignore_errors=True)
    try:
        path.mkdir(mode=0o700)
    except OSError:
        return False
    return True


def worker_environment(launch: Mapping[str, str], server: Mapping[str, str],
                       now: Mapping[str, str]) -> dict[str, str]:
    """The environment a forked worker must have, as a fresh one would (pure).

    ``launch``: the supervisor's environment when the attempt's workers started (a fresh
    worker's whole environment, before the agent's variables); ``server``: the fork server's
    environment when it started (`SERVER_ENV`); ``now``: the child's environment as forked,
    with the agent's variables for this rank set on it. Every variable of ``now`` that differs
    from ``server`` was set since (the agent's RANK, MASTER_PORT, TORCHELASTIC_* ..., or what
    importing torch set, as it would in a fresh worker) and is kept; everything else is
    ``launch``'s: a variable the supervisor set or changed since the server started is seen,
    one it removed is gone."""
    out = dict(launch)
    out.update({k: v for k, v in now.items() if server.get(k) != v})
    return out


def thread_count(env: Mapping[str, str], server: Mapping[str, str]) -> int | None:
    """The intra-op thread count torch must take in a forked worker whose environment is
    ``env``, when the server's (``server``) gave it another at import (None: the same).
    ``OMP_NUM_THREADS`` as OpenMP reads it (a positive integer; else, or unset, every CPU this
    process may run on)."""
    wanted, had = env.get("OMP_NUM_THREADS"), server.get("OMP_NUM_THREADS")
    if wanted == had:
        return None
    with contextlib.suppress(TypeError, ValueError):
        n = int(str(wanted).strip())
        if n > 0:
            return n
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def match_threads(env: Mapping[str, str], server: Mapping[str, str]) -> None:
    """Give torch (when imported) the thread count ``env`` asks for (`thread_count`)."""
    n = thread_count(env, server)
    torch = sys.modules.get("torch")
    if n is not None and torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(n)


def cuda_started() -> bool:
    """Whether torch already initialized CUDA in this process (in a forked worker: in the
    server, which must never happen). Never initializes it."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda.is_initialized()) if cuda is not None else False
    except Exception:
        return False


def run_rank_pids(temp_root: str | Path, supervisor_pid: int, rank: int) -> list[int]:
    """The live process of global ``rank`` in the newest attempt of the run whose supervisor
    is ``supervisor_pid``, its session directory under ``temp_root`` (the run's TMPDIR)."""
    attempts = sorted(Path(temp_root).glob(f"{RUN_PREFIX}{supervisor_pid}-*/attempt*"),
                      key=lambda p: int(p.name.removeprefix("attempt") or 0))
    return rank_pids(attempts[-1], rank) if attempts else []


def rank_pids(run_dir: str | Path, rank: int) -> list[int]:
    """The live process of global ``rank`` that an attempt's run directory names (its
    ``rank<N>.pid``, `resilient_strategy.records.handoff.write_pid`: the worker writes it in
    both starts), as a list (empty: none)."""
    from ..machine.files import read_json

    found: list[int] = []
    for path in sorted(Path(run_dir).glob("rank*.pid")):
        try:
            data = read_json(path, max_bytes=4096)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("rank") != rank:
            continue
        pid = data.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool) and alive(pid):
            found.append(pid)
    return found

