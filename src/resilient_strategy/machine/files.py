"""Every file this package reads or writes goes through here: private directories, bounded and
checked reads, atomic writes, and sweeping what a killed run left behind.

Trust: a directory this package keeps state in (the decision cache, the agreement between local
ranks) must be this user's own: a directory, owned by the effective uid, not writable by group or
others. One that does not exist is created with mode 0700 (its missing parents too). A symlink is
followed only when this user owns it and its target passes the same checks. A file read from such a
directory (``owned=True``) is opened with ``O_NOFOLLOW`` and must be a regular file owned by this
user and not writable by group or others. Files the user names (rules, ``--simulate`` machine
files) may be anyone's, but must be regular files (a FIFO would block the reader forever).

Bounds: every read stops at a byte limit, and JSON or TOML nested deeper than `MAX_DEPTH`
is refused, so a hostile or broken file costs a bounded amount of memory and time and ends in a
typed error (`UnsafePathError`,
`FileFormatError`), never a ``RecursionError`` or
``MemoryError`` from deep inside.

Writes: to a temporary file in the destination's directory (mode 0600), flushed and fsynced, then
renamed over the destination, so a reader sees the old file, no file, or the whole new one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..core.values.bounded import (
    MAX_DEPTH,
    MAX_MACHINE_BYTES,
    MAX_RULES_BYTES,
    NOT_REGULAR,
    check_depth,
    parse_json,
    parse_toml,
    read_user_file,
)
from ..errors import FileFormatError, NoSpaceError, UnsafePathError
from ..process import PROCESS
from . import procs

__all__ = ["MAX_DEPTH", "MAX_MACHINE_BYTES", "MAX_RULES_BYTES", "NOT_REGULAR", "check_depth",
           "parse_json", "parse_toml", "read_user_file"]  # re-exported from ._bounded

log = logging.getLogger("resilient_strategy")
#: The warnings that a file or directory is not safely this user's (warn_once): a logger of
#: their own, so that the command line shows them while it quiets the rest.
trust_log = logging.getLogger("resilient_strategy.files")

#: Byte limits per kind of file: far above what an honest file holds, far below a memory problem.
MAX_CACHE_BYTES = 8 << 20
MAX_AGREEMENT_BYTES = 8 << 20
MAX_REPORT_BYTES = 1 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Process-wide by nature: a warning is said once per process (`warn_once`), whoever asks.
_warned: set[str] = PROCESS.hold(
    "machine.files.warned", set, "the keys of the warnings said once per process (warn_once)")


def _euid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        trust_log.warning("resilient_strategy: %s", message)


# --------------------------------------------------------------------------------------------
# Directories
# --------------------------------------------------------------------------------------------
def ensure_private_dir(path: Path, *, fix: str = "") -> Path:
    """``path`` as a directory of this user's own, created with mode 0700 (and its missing parents)
    when absent. Raises UnsafePathError when it exists but is not safely ours, OSError when it
    cannot be created."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another process made it meanwhile: checked below
            continue
        with contextlib.suppress(OSError):  # the umask may have taken bits away: ours to set
            os.chmod(d, 0o700)
    check_private_dir(path, fix=fix)
    return path


def check_private_dir(path: Path, *, fix: str = "", follow_links: bool = True) -> None:
    """Raise UnsafePathError unless ``path`` is a directory owned by this user and not writable by
    group or others (a symlink only when this user owns it and its target passes too, and never
    with ``follow_links=False``: the directories inside one of ours, such as a checkpoint's)."""
    if sys.platform == "win32":  # pragma: no cover - no POSIX owners
        return
    where = str(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and not follow_links:
        raise UnsafePathError(where, "is a symbolic link", fix or _fix_dir(where))
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != _euid():
            raise UnsafePathError(
                where, f"is a symbolic link owned by uid {st.st_uid}, not by this user "
                f"(uid {_euid()})", fix or _fix_dir(where))
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(where, "is not a directory", fix or _fix_dir(where))
    if st.st_uid != _euid():
        raise UnsafePathError(
            where, f"is owned by uid {st.st_uid}, not by this user (uid {_euid()}), so what it "
            "holds cannot be trusted", fix or _fix_dir(where))
    if st.st_mode & 0o022:
        raise UnsafePathError(
            where, f"is writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode "
            f"{stat.S_IMODE(st.st_mode):o}), so another user could plant files in it",
            fix or f"Run `chmod go-w {where}`, or {_OTHER_DIR}")


_OTHER_DIR = "point RESILIENT_STRATEGY_CACHE_DIR (or cache_dir=) at a directory of your own"


def _fix_dir(where: str) -> str:
    return f"Remove or rename {where}, or {_OTHER_DIR}."


def check_private_files(directory: Path, *, fix: str = "") -> dict[str, int]:
    """Every entry of ``directory`` (one of ours, already checked) as a regular file of this
    user's, not writable by group or others, not a symlink (looked at without following or
    opening anything); returns each name's size. Raises UnsafePathError naming the first entry
    that is not (another user's file, a symlink, a FIFO, a directory)."""
    sizes: dict[str, int] = {}
    for name in sorted(os.listdir(directory)):
        where = os.path.join(directory, name)
        st = os.lstat(where)
        problem = ("is a symbolic link" if stat.S_ISLNK(st.st_mode)
                   else NOT_REGULAR if not stat.S_ISREG(st.st_mode)
                   else f"is owned by uid {st.st_uid}, not by this user (uid {_euid()})"
                   if sys.platform != "win32" and st.st_uid != _euid()
                   else f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
                   if st.st_mode & 0o022 else "")
        if problem:
            raise UnsafePathError(where, problem, fix or _fix_file(where))
        sizes[name] = st.st_size
    return sizes


def make_private(path: Path) -> None:
    """Take group's and others' access away from ``path`` and, when it is a directory, from
    everything under it (0700 directories, 0600 files; symlinks are left alone, never followed):
    for files another library wrote with its own modes (torch's distributed checkpoint)."""
    for root, dirs, names in os.walk(path, followlinks=False):
        os.chmod(root, 0o700)
        for name in names:
            where = os.path.join(root, name)
            if not os.path.islink(where):
                os.chmod(where, 0o600)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]


@contextlib.contextmanager
def private_umask() -> Any:
    """Files and directories created meanwhile are this user's alone (umask 077), for writers
    that choose their own modes; the process's umask is restored after."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Any:
    """Around a write of ``path``: a full disk, an exhausted quota or a read-only filesystem
    becomes one typed line (`resilient_strategy.errors.NoSpaceError` naming the file)
    instead of an OSError's traceback, also when a writer (torch.save) wrapped that OSError in
    an error of its own; any other error passes unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # RuntimeError: torch.save's zip writer wraps it
        cause: BaseException | None = exc
        for _ in range(8):  # the exception and what it was raised from or during
            if cause is None:
                break
            typed = (NoSpaceError.from_os_error(cause, str(path), what)
                     if isinstance(cause, OSError) else None)
            if typed is not None:
                raise typed from exc
            cause = cause.__cause__ or cause.__context__
        raise


def safe_name(name: str) -> bool:
    """Whether ``name`` can be one file name of ours in a directory of ours: letters, digits,
    ``-``, ``_`` and ``.`` only, not starting with a dot, at most 128 characters (so a name the
    user typed, a fingerprint, never walks out of the directory)."""
    return (0 < len(name) <= 128 and not name.startswith(".")
            and all(c.isascii() and (c.isalnum() or c in "-_.") for c in name))


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the filesystem of ``path``; None when unknown."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # AttributeError: no statvfs on Windows
        return None
    return st.f_bavail * st.f_frsize


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def read_bytes(path: Path, *, max_bytes: int, owned: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    ``owned``: the file lives in one of this package's directories, so it must not be a symlink
    and must be this user's own and not writable by group or others (else UnsafePathError).
    Raises FileNotFoundError (an OSError) when absent, FileFormatError when larger than
    ``max_bytes``, OSError when unreadable.
    """
    if not owned:
        return read_user_file(path, max_bytes)
    where = str(path)
    fd, st = _open_owned_fd(path)
    try:
        if st.st_size > max_bytes:
            raise FileFormatError(where, f"is {st.st_size} bytes, more than the {max_bytes} "
                                  "this reader takes")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # grew while read
            raise FileFormatError(where, f"holds more than the {max_bytes} bytes this reader takes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_tail(path: Path, *, max_bytes: int, owned: bool = True) -> bytes:
    """The last ``max_bytes`` bytes of the regular file ``path`` (all of it when smaller): a log
    or dump another process wrote, kept for a person to read. Opened as `read_bytes` opens
    (never through a symlink, never blocking on a FIFO; with ``owned``: this user's own, not
    writable by group or others; without: any regular file). Raises UnsafePathError,
    FileNotFoundError, OSError."""
    where = str(path)
    if owned:
        fd, st = _open_owned_fd(path)
    else:
        try:
            fd = os.open(path, os.O_RDONLY | _CLOEXEC | _NONBLOCK | _NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
                raise UnsafePathError(where, "is a symbolic link", _fix_file(where)) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePathError(where, NOT_REGULAR, _fix_file(where))
    try:
        os.lseek(fd, max(0, st.st_size - max_bytes), os.SEEK_SET)
        chunks: list[bytes] = []
        size = 0
        while size < max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a symlink, FIFO, device or directory),
    looked at without following or opening anything; False when absent or unreadable."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _open_owned_fd(path: Path, *, private: bool = True) -> tuple[int, os.stat_result]:
    """``path`` opened read-only (never through a symlink, never blocking on a FIFO) and checked:
    a regular file, this user's own and, where ``private``, not writable by group or others.
    The caller closes it."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC | _NONBLOCK | _NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise UnsafePathError(where, "is a symbolic link", _fix_file(where)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(where, NOT_REGULAR, _fix_file(where))
        if sys.platform != "win32":
            if st.st_uid != _euid():
                raise UnsafePathError(
                    where, f"is owned by uid {st.st_uid}, not by this user (uid {_euid()})",
                    _fix_file(where))
            if private and st.st_mode & 0o022:
                raise UnsafePathError(
                    where, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})",
                    _fix_file(where))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_owned(path: Path) -> Any:
    """``path`` opened for reading (a binary file object), with the rules of `read_bytes`
    for ``owned=True`` but no size bound: a regular file, not through a symlink, this user's
    own, not writable by group or others; never blocking on a FIFO. For large files a reader
    streams (checkpoints). Raises UnsafePathError, FileNotFoundError, OSError."""
    fd, _ = _open_owned_fd(path)
    return os.fdopen(fd, "rb")


def open_regular(path: Path) -> Any:
    """``path`` opened for reading as a text stream (errors replaced) when it is a regular file
    of this user's own: never through a symlink, never blocking on a FIFO (opened with
    ``O_NONBLOCK``, then checked with ``fstat``); the mode is not asked (a log another process
    of ours writes, tailed to the console). Raises UnsafePathError, FileNotFoundError,
    OSError."""
    fd, _ = _open_owned_fd(path, private=False)
    try:
        os.set_blocking(fd, True)  # a regular file: reads never wait anyway
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "r", errors="replace")


def _fix_file(where: str) -> str:
    return f"Remove {where} (this package did not write it); it is ignored meanwhile."


def read_json(path: Path, *, max_bytes: int, owned: bool = True,
              max_depth: int = MAX_DEPTH) -> Any:
    """`read_bytes` then `parse_json`."""
    return parse_json(read_bytes(path, max_bytes=max_bytes, owned=owned), str(path),
                      max_depth=max_depth)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_writer(path: str | Path, *, durable: bool = True, what: str = "a file of this run",
                  suffix: str = "", before_replace: Callable[[], None] | None = None,
                  prefix: str = ".tmp-") -> Iterator[BinaryIO]:
    """The one way this package replaces a file whole: a temporary file (mode 0600, never
    through a symlink) in ``path``'s directory, handed to the block to write; then flushed,
    fsynced (unless ``durable=False``: still atomic for every reader, only not kept through a
    power loss), ``before_replace`` called (the checkpoint keeps its previous one there), and
    renamed over ``path``. A full or read-only filesystem is a NoSpaceError naming ``path`` and
    ``what``; on any error no temporary file is left and the old file is whole. ``prefix``
    names the temporary file (the checkpoint's writer puts its pid there, so that a sweep
    knows a dead writer's file)."""
    path = Path(path)
    with writing(path, what):
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                yield fh
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
            if before_replace is not None:
                before_replace()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_bytes_atomic(path: str | Path, data: bytes, *, durable: bool = True,
                       what: str = "a file of this run", suffix: str = "") -> None:
    """Write ``data`` to ``path`` atomically (`atomic_writer`)."""
    with atomic_writer(path, durable=durable, what=what, suffix=suffix) as fh:
        fh.write(data)


def write_json_atomic(path: str | Path, value: Any, *, indent: int | None = None,
                      sort_keys: bool = False, allow_nan: bool = False,
                      durable: bool = True, what: str = "a file of this run") -> None:
    """Write ``value`` as JSON to ``path`` atomically (`atomic_writer`). Raises
    ValueError/TypeError for what JSON cannot hold (before touching the disk), NoSpaceError
    (naming ``path`` and ``what``) on a full or read-only filesystem, OSError when the write
    fails otherwise; no temporary file is left either way, the old file is whole.
    ``durable=False`` skips the fsync (for files that matter only while this job runs: the
    agreement, probe reports, progress marks)."""
    text = json.dumps(value, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan)
    write_bytes_atomic(path, text.encode("utf-8"), durable=durable, what=what, suffix=".json")


def keep_previous(path: str | Path, previous: str | Path) -> OSError | None:
    """Keep ``path`` also as ``previous`` (a hard link renamed over it: ``path`` stays whole
    throughout), before ``path`` is replaced; nothing where ``path`` does not exist. The error
    where it could not be (best effort: the caller says so and goes on)."""
    path, previous = Path(path), Path(previous)
    if not os.path.lexists(path):
        return None
    link = previous.with_name(f".prev-{os.getpid()}{previous.suffix}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        os.link(path, link, follow_symlinks=False)
        os.replace(link, previous)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(link)
        return exc
    return None


def set_aside(path: str | Path, aside: str | Path, *, keep_existing: bool = False) -> bool:
    """Rename a damaged file out of the way (``aside``), so that it is kept for a person to
    look at and never read again; False where it could not be (or, with ``keep_existing``,
    ``aside`` already exists). Never raises."""
    try:
        if keep_existing and os.path.lexists(aside):
            return False
        os.replace(path, aside)
    except OSError:
        return False
    return True


def open_lock(path: Path) -> int:
    """A descriptor of the lock file ``path`` (created 0600, never through a symlink)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)


# --------------------------------------------------------------------------------------------
# Temporary directories of this process, and sweeping those a killed run left
# --------------------------------------------------------------------------------------------
#: Prefixes of the temporary directories this package creates (``<prefix><pid>-<random>``).
TEMP_PREFIXES = ("rs-probe-", "rs-proc-")
#: A dead process's temporary directory is swept once it is this old (seconds since modified).
SWEEP_AFTER_S = 600.0


def temp_dir(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary directory named ``<prefix><pid>-...`` (mode 0700), so a later run can tell a
    dead owner's leftovers apart from a live run's."""
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-",
                                       ignore_cleanup_errors=True)


def sweep_temp_dirs(
    directory: str | None = None,
    prefixes: tuple[str, ...] = TEMP_PREFIXES,
    *,
    min_age_s: float | None = None,
    now: float | None = None,
) -> list[str]:
    """Remove temporary directories that a killed run of this package left in ``directory``
    (default: the temp dir): only directories (never symlinks) owned by this user, named with a
    prefix of ours and the pid of a process that no longer exists, unmodified for ``min_age_s``
    (default `SWEEP_AFTER_S`). Returns the removed paths. Never raises."""
    directory = directory or tempfile.gettempdir()
    min_age_s = SWEEP_AFTER_S if min_age_s is None else min_age_s
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        pid_text = name[len(prefix):].partition("-")[0]
        if not pid_text.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != _euid()
                or now - st.st_mtime < min_age_s or _alive(int(pid_text))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def sweep_orphan_files(directory: str | Path, prefixes: tuple[str, ...]) -> list[str]:
    """Remove the temporary files a killed writer left in ``directory`` (one of ours, already
    checked): regular files (never symlinks) of this user's named ``<prefix><pid>-...`` or
    ``<prefix><pid>.<ext>``, whose process no longer exists on this machine. Returns the removed
    paths. Never raises."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        rest = name[len(prefix):]
        pid_text = rest[:next((i for i, c in enumerate(rest) if not c.isdigit()), len(rest))]
        if not pid_text or rest[len(pid_text):][:1] not in ("-", ".") or _alive(int(pid_text)):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == _euid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    """Whether the writer ``pid`` named in a file's name may still run: a number no process can
    have is not a pid we wrote (left alone), else `procs.alive`."""
    return not procs.could_be_pid(pid) or procs.alive(pid)


class TempSweep:
    """Sweeps what killed runs left (`sweep_temp_dirs`) once per holder: the prober holds
    the process's one instance (`TEMP_SWEEP`), so the temp directory is read once per
    process however many probes run; a test holds its own."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def once(self) -> None:
        if not self.done:
            self.done.append(tempfile.gettempdir())
            sweep_temp_dirs()


#: This process's sweep (see `TempSweep`).
TEMP_SWEEP = PROCESS.hold("machine.files.temp_sweep", TempSweep,
                          "the temporary entries this process sweeps (TempSweep)")
