"""Who holds a TCP port on this machine, from ``/proc`` (Linux): the sockets bound to it
(``/proc/net/tcp`` and ``/proc/net/tcp6``: local address, state, owner's uid, inode), and the
processes whose descriptors are those sockets (``/proc/<pid>/fd/*`` -> ``socket:[inode]``).

A launch whose rendezvous port is taken (``EADDRINUSE``) is told which process holds it
(`port_holders`), so that the one line the supervisor prints names it. The parsers
(`parse_sockets`, `socket_inode`) are pure and tested from strings; `port_holders` is the thin
reader: it never raises, reads each file bounded, and looks at no more than ``max_pids``
processes. A process of another user is visible only to root; the socket's owner (its uid) is
named all the same.

Field layout: proc(5), ``/proc/net/tcp``: after a header line, one socket a line; field 2 the
local address ``HEXADDR:HEXPORT`` (IPv4: 8 hex digits, IPv6: 32), field 4 the state in hex
(``0A`` LISTEN, ``06`` TIME_WAIT, ``07`` CLOSE), field 8 the owner's uid, field 10 the inode
(0 for a socket no descriptor holds, as in TIME_WAIT).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

#: The state of a listening socket in ``/proc/net/tcp``.
LISTEN = 0x0A
#: The most of a ``/proc/net/tcp*`` file read (a line is 150 bytes: some 28,000 sockets).
MAX_TABLE_BYTES = 4 << 20
#: The most of a command line read, and the most processes looked at for a socket's holder.
MAX_CMDLINE_BYTES = 4096
MAX_PIDS = 8192

_SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")


@dataclass(frozen=True)
class Bound:
    """A socket bound to a port: its state (``LISTEN`` ...), its owner's uid, its inode (0:
    held by no descriptor, e.g. TIME_WAIT)."""

    port: int
    state: int
    uid: int
    inode: int

    @property
    def listening(self) -> bool:
        return self.state == LISTEN


@dataclass(frozen=True)
class Holder:
    """A process whose descriptor is a socket bound to the port (pid 0: the socket's owner is
    known, its process is not visible here), its command line (cut), its owner's uid."""

    pid: int
    command: str
    uid: int

    def words(self, limit: int = 32) -> str:
        """``pid 123 (python train.py)``: the program's name without its directory, and its
        arguments, cut to ``limit`` characters."""
        if self.pid <= 0:
            return f"a process of uid {self.uid} (not visible to this user)"
        program, _, args = self.command.partition(" ")
        short = " ".join(p for p in (program.rsplit("/", 1)[-1], args) if p)
        if len(short) > limit:
            short = short[:limit - 3].rstrip() + "..."
        return f"pid {self.pid} ({short})" if short else f"pid {self.pid}"

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "command": self.command, "uid": self.uid}


def parse_sockets(text: str, port: int) -> tuple[Bound, ...]:
    """The sockets of a ``/proc/net/tcp`` or ``tcp6`` table bound to ``port`` (pure; lines that
    are not a socket's are skipped), listening ones first."""
    found: list[Bound] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or ":" not in fields[1]:
            continue
        try:
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            state, uid, inode = int(fields[3], 16), int(fields[7]), int(fields[9])
        except ValueError:
            continue
        if local_port == port:
            found.append(Bound(local_port, state, uid, inode))
    return tuple(sorted(found, key=lambda b: not b.listening))


def socket_inode(link: str) -> int | None:
    """The inode a descriptor's link names (``socket:[123]`` -> 123; None: not a socket)."""
    m = _SOCKET_LINK.match(link)
    return int(m.group(1)) if m else None


def command_words(cmdline: bytes, limit: int = 80) -> str:
    """A ``/proc/<pid>/cmdline`` (NUL-separated) as one line of at most ``limit`` characters."""
    words = " ".join(p.decode("utf-8", "replace") for p in cmdline.split(b"\0") if p)
    words = "".join(c if c.isprintable() else "?" for c in words)
    return words if len(words) <= limit else words[:limit - 3] + "..."


def _read(path: str, limit: int) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(limit)


def bound_sockets(port: int, root: str = "/proc") -> tuple[Bound, ...]:
    """The sockets bound to ``port`` on this machine (IPv4 and IPv6; none where ``/proc`` cannot
    be read)."""
    found: list[Bound] = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            found.extend(parse_sockets(_read(f"{root}/net/{table}", MAX_TABLE_BYTES)
                                       .decode("ascii", "replace"), port))
    return tuple(sorted(found, key=lambda b: not b.listening))


def port_holders(port: int, root: str = "/proc", max_pids: int = MAX_PIDS
                 ) -> tuple[Holder, ...]:
    """The processes holding a socket bound to ``port`` (listening ones first), found through
    their descriptors; where a socket's process is not visible (another user's, without root),
    a `Holder` with pid 0 and the socket's uid. Empty where nothing is bound, or on another OS.
    Never raises."""
    sockets = [b for b in bound_sockets(port, root) if b.inode]
    if not sockets:
        return ()
    wanted = {b.inode: b for b in sockets}
    holders: dict[int, Holder] = {}
    seen: set[int] = set()
    with contextlib.suppress(OSError):
        names = sorted((int(n) for n in os.listdir(root) if n.isdigit()), reverse=True)
        for pid in names[:max_pids]:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"{root}/{pid}/fd"):
                    inode = None
                    with contextlib.suppress(OSError):
                        inode = socket_inode(os.readlink(f"{root}/{pid}/fd/{fd}"))
                    if inode is None or inode not in wanted or pid in holders:
                        continue
                    seen.add(inode)
                    command = ""
                    with contextlib.suppress(OSError):
                        command = command_words(_read(f"{root}/{pid}/cmdline",
                                                      MAX_CMDLINE_BYTES))
                    holders[pid] = Holder(pid, command, wanted[inode].uid)
            if len(seen) == len(wanted):
                break
    unseen = [Holder(0, "", b.uid) for b in sockets if b.inode not in seen]
    return (*sorted(holders.values(), key=lambda h: h.pid), *unseen[:1])
