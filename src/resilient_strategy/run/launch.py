"""Launch faults in words (pure): a failure whose evidence points at the launch, not at a
strategy (`core.knowledge.causes.LAUNCH_CAUSES`: a rendezvous port already held, a store that
cannot be reached, a name that does not resolve, a library that breaks ``import torch``, CUDA
initialised too early) gets one line naming the thing and its fix.

Two ways in: a rank's error or output placed on a launch cause (`verdicts.classify_attempt`
gives a ``launch`` verdict), and an exception torch's elastic agent raised before any worker
started (`raised`: the rendezvous store on a held ``--master-port``). The supervisor looks the
holder of a held port up in ``/proc`` (`machine.ports.port_holders`, effectful) and hands it to
`named`; everything here takes data and returns data.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from ..core.knowledge.causes import LAUNCH_CAUSES
from ..core.knowledge.signatures import Signatures, builtin_signatures
from ..core.values.human import fit
from ..machine.ports import Holder
from .verdicts import SEEN_EXIT, Verdict, VerdictKind, error_words, quiet

#: Where a port is named in torch's socket errors: "port: 29500" (torch >= 2.4), "bind to
#: [::]:29500 (errno: 98 ...)" (older), "connect to (127.0.0.1, 29500)" (a client).
_PORT = (re.compile(r"\bport:? (\d{1,5})\b"),
         re.compile(r"\]:(\d{1,5}) \(errno"),
         re.compile(r"(?:\d{1,3}\.){3}\d{1,3}:(\d{1,5}) \(errno"),
         re.compile(r"connect to \(\s*[^,()\s]+,\s*(\d{1,5})\)"))
_HOST = re.compile(r"connect to \(\s*([^,()\s]+),\s*\d{1,5}\)|host (?:not found|name) "
                   r"['\"]?([\w.-]+)")
#: The library and symbol a broken import names ("undefined symbol: ncclCommRegister",
#: "libnccl.so.2: cannot open shared object file").
_LIBRARY = re.compile(r"(?:[\w.+-]*/)?(lib[\w+-]+\.so[.\d]*): (undefined symbol: \w+|cannot open "
                      r"shared object file)|(undefined symbol: \w+)")

#: Each launch cause's fix, short (the cause's full words are in `causes.CAUSES` and the
#: troubleshooting page).
FIXES = {
    "port_in_use": "stop it or pass a free --master-port",
    "store_unreachable": "check that MASTER_ADDR:MASTER_PORT names the node that hosts it "
                         "and that it is up",
    "name_unresolved": "give an IP address, or fix /etc/hosts or DNS",
    "torch_import": "take the older library off LD_LIBRARY_PATH (or uninstall the extra "
                    "nvidia-nccl package)",
    "cuda_initialized": "move that CUDA call below resilient_strategy(), or start workers "
                        "with 'spawn'",
}


def port_in(text: str) -> int | None:
    """The port a socket error names (None: none, or not a port). Pure."""
    for pattern in _PORT:
        m = pattern.search(text)
        if m and 0 < int(m.group(1)) < 65536:
            return int(m.group(1))
    return None


def thing(cause: str, text: str, port: int | None = None,
          holders: Sequence[Holder] = ()) -> str:
    """What a launch fault is about, in a few words: the port and who holds it, the store's
    address, the library. Pure."""
    if cause == "port_in_use":
        where = f"port {port}" if port else "the rendezvous port"
        by = ", ".join(h.words() for h in holders[:2]) + (" and others" if len(holders) > 2
                                                          else "")
        return f"{where} is held by {by}" if by else f"{where} is already in use"
    if cause == "store_unreachable":
        m = _HOST.search(text)
        at = f" at {m.group(1)}:{port}" if m and m.group(1) and port else ""
        return f"the rendezvous store{at} cannot be reached"
    if cause == "name_unresolved":
        m = _HOST.search(text)
        name = next((g for g in (m.groups() if m else ()) if g), "")
        return f"the host name {name} does not resolve" if name else \
            "a host name of the launch does not resolve"
    if cause == "torch_import":
        m = _LIBRARY.search(text)
        said = (f"{m.group(1)}: {m.group(2)}" if m and m.group(1) else m.group(3) if m else "")
        return "import torch fails" + (f" ({said})" if said else "")
    if cause == "cuda_initialized":
        return "CUDA was initialised before the decision or before a fork"
    return "the launch failed"


def words(cause: str, text: str, port: int | None = None,
          holders: Sequence[Holder] = (), limit: int = 180) -> str:
    """The one line of a launch fault: the thing, then its fix. Pure."""
    return fit(f"{thing(cause, text, port, holders)}: {FIXES.get(cause, 'fix the launch')}",
               limit)


def named(verdict: Verdict, holders: Sequence[Holder] = ()) -> Verdict:
    """A ``launch`` verdict with its line (`words`) as its detail and the pids of the port's
    holders (``holders``: what ``/proc`` showed, the caller's lookup). Pure."""
    if verdict.kind is not VerdictKind.LAUNCH:
        return verdict
    port = port_in(verdict.summary)
    return replace(verdict, detail=words(verdict.cause, verdict.summary, port, holders),
                   held_by=tuple(h.pid for h in holders))


def cause_of(texts: Sequence[str], signatures: Signatures | None = None) -> str:
    """The launch cause the signature table places on any of ``texts`` ("": none). Pure."""
    table = signatures or builtin_signatures()
    for text in texts:
        placed = table.classify(text) if text.strip() else ""
        if placed in LAUNCH_CAUSES:
            return placed
    return ""


def raised(chain: Sequence[tuple[Sequence[str], str]]) -> Verdict | None:
    """The verdict on an attempt whose launch raised before any worker started (torch's agent
    creating the rendezvous store, say), from the exception chain (each exception's MRO names
    and message, the exception first); None when its text is no launch fault (the caller
    re-raises it). Pure."""
    cause = cause_of([message for _, message in chain])
    if not cause:
        return None
    types, message = chain[0]
    name = next(iter(types), "Error").rsplit(".", 1)[-1]
    said = quiet(f"{name}: {message}")
    return Verdict(VerdictKind.LAUNCH, f"the launch failed before any worker started: {said}",
                   0, cause, where="rendezvous", detail=error_words(said), seen=SEEN_EXIT)


def chain_of(exc: BaseException, depth: int = 8) -> list[tuple[list[str], str]]:
    """An exception and its causes as `raised` reads them (MRO names, message). Pure."""
    out: list[tuple[list[str], str]] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(out) < depth:
        seen.add(id(cur))
        out.append(([f"{c.__module__}.{c.__qualname__}" for c in type(cur).__mro__],
                    str(cur)))
        cur = cur.__cause__ or cur.__context__
    return out
