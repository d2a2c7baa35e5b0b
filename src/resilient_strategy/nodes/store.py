"""A multi-node job and its store: this node's place in the job (`Job`), the launcher's own
TCPStore opened as client or host, a key/value `Channel` with deadlines, the per-node
`Heartbeat`, and the fault records the supervisors of a ``run`` read before relaunching
(`record_fault` / `recorded_faults`).

Our keys live under their own prefix with the restart count (``resilient_strategy/v1/<run id>/
<restart>/``), apart from torch's own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import MultiNodeError, NodeLostError, StoreValueError
from ..process import PROCESS
from .messages import decode

T = TypeVar("T")

log = logging.getLogger("resilient_strategy")

ROUTE = "@route"
KEY_VERSION = "v1"

MARGIN_FLOOR_S = 10.0
#: Every node's decider beats this often; a node silent for HEARTBEAT_STALE_S is lost.
HEARTBEAT_S = 0.5
HEARTBEAT_STALE_S = 10.0

@dataclass(frozen=True)
class Job:
    """This node's place in a multi-node launch, and where the job's store is."""

    node: int
    nodes: int
    local_world: int
    rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store; else global rank 0 hosts it
    prefix: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Job | None:
        """The job from torchrun's variables; None when they do not describe a multi-node job
        with a store (then the nodes cannot talk, and plan from the rules alone)."""
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
            rank = int(env.get("RANK", "0"))
            port = int(env.get("MASTER_PORT", ""))
        except ValueError:
            return None
        addr = env.get("MASTER_ADDR", "")
        if not addr or not 0 < local < world or world % local or not 0 < port < 65536:
            return None
        try:
            node = int(env.get("GROUP_RANK", str(rank // local)))
        except ValueError:
            node = rank // local
        run = env.get("TORCHELASTIC_RUN_ID", "none")
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(
            node=node, nodes=world // local, local_world=local, rank=rank, master_addr=addr,
            master_port=port, agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            prefix=f"resilient_strategy/{KEY_VERSION}/{run}/{restart}/",
        )

    @property
    def store_text(self) -> str:
        who = "torchrun's agent store" if self.agent_store else "hosted by rank 0 (multi-tenant)"
        return f"{self.master_addr}:{self.master_port} ({who}, keys under {self.prefix})"


#: Stores this process hosts (non-agent launches): kept alive so that ``init_process_group``
#: on the same port reuses the server (``multi_tenant=True``) instead of failing to bind.
#: Process-wide by nature: torch's process group finds the server by port, not through us.
HOSTED: list[Any] = PROCESS.hold(
    "nodes.store.hosted", list, "the TCPStores this process hosts, kept alive for the job")


def open_store(job: Job, timeout_s: float, *, client: bool = False) -> Any:
    """A TCPStore connection to the job's store (torch imported here, lazily); global rank 0
    hosts it when torchrun's agent does not (unless ``client``)."""
    try:
        import importlib

        dist: Any = importlib.import_module("torch.distributed")
    except ImportError as exc:
        raise MultiNodeError(f"a multi-node job needs torch.distributed to agree: {exc}") from exc
    host = not job.agent_store and job.rank == 0 and not client
    try:
        store = dist.TCPStore(
            job.master_addr, job.master_port, is_master=host,
            timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=host,
        )
    except (RuntimeError, OSError, ValueError) as exc:
        raise NodeLostError(
            f"node {job.node} cannot reach the job's store at {job.store_text} within "
            f"{timeout_s:g} s: {first_line(exc)}", how="store"
        ) from exc
    if host:
        HOSTED.append(store)
    # every call we make is short (a key is read only once it is there; waits poll): a call
    # that takes longer than the heartbeat window is a store out of reach, not a slow answer
    # (the connection above may take the whole ``timeout_s``: the nodes start apart)
    with contextlib.suppress(AttributeError, RuntimeError, ValueError):
        store.set_timeout(timedelta(seconds=min(timeout_s, HEARTBEAT_STALE_S)))
    return store


class Channel:
    """JSON objects under the job's key prefix, each read with its own deadline.

    A wait for a node's answer also watches that node's heartbeat (`Heartbeat`): a node
    whose decider stopped beating for `HEARTBEAT_STALE_S` is lost at once, not at the end
    of the wait (a node merely busy in a hung probe still beats).
    """

    def __init__(self, store: Any, prefix: str, poll_s: float = 0.05) -> None:
        self.store = store
        self.prefix = prefix
        self.poll_s = poll_s
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last count, when it changed)

    def put(self, key: str, value: Mapping[str, Any]) -> None:
        try:
            self.store.set(self.prefix + key, json.dumps(value, allow_nan=False))
        except (RuntimeError, OSError) as exc:
            raise NodeLostError(f"the job's store stopped answering: {first_line(exc)}",
                                how="store") from exc

    def take(self, key: str, timeout_s: float, missing: str, who: int | None = None
             ) -> dict[str, Any]:
        """The object at ``key`` once it is there (`take_as` with no further check)."""
        return self.take_as(key, _as_is, timeout_s, missing, who)

    def take_as(self, key: str, read: Callable[[dict[str, Any]], T], timeout_s: float,
                missing: str, who: int | None = None) -> T:
        """``read`` of the object at ``key`` once one it accepts is there; `NodeLostError`
        after ``timeout_s``, or as soon as node ``who`` (the one to write it) stops beating.

        Every value is read through the bounded reader (`messages.decode`, then ``read``,
        which raises `MultiNodeError` or ValueError for a value it refuses; any other exception
        of ``read`` is a refusal too): a refused value (forged, malformed, of another version) is one logged line
        naming the key (`refused`), and the key counts as not written yet: the writer's own
        value, when it replaces it, is taken; the deadline's error says what was refused."""
        full = self.prefix + key
        deadline = time.monotonic() + timeout_s
        refused_raw: bytes | None = None
        problem = ""
        try:
            while True:
                if self.store.check([full]):
                    raw = bytes(self.store.get(full))
                    if raw != refused_raw:
                        try:
                            return accept(full, raw, read)
                        except StoreValueError as exc:
                            refused_raw, problem = raw, exc.problem
                now = time.monotonic()
                if now >= deadline:
                    seen = (f" (the value there was refused: {problem})" if refused_raw is not None
                            else "")
                    raise NodeLostError(
                        f"{missing} within {timeout_s:.3g} s{seen}; it may have died or hung: "
                        "see its log", who)
                if who is not None and self.stale(who, now):
                    raise NodeLostError(
                        f"{missing}: node {who} stopped beating (no heartbeat for "
                        f"{HEARTBEAT_STALE_S:g} s): its processes died or froze", who,
                        "heartbeat")
                time.sleep(self.poll_s)
        except (RuntimeError, OSError) as exc:
            raise NodeLostError(
                f"{missing}: the job's store stopped answering ({first_line(exc)}); the node "
                "that hosts it may have died: see its log", how="store"
            ) from exc

    def peek_as(self, key: str, read: Callable[[dict[str, Any]], T]) -> T | None:
        """``read`` of the object at ``key`` if one is there and accepted, else None (a refused
        value logged once, as by `take_as`); never waits. Raises RuntimeError / OSError
        when the store does not answer."""
        full = self.prefix + key
        if not self.store.check([full]):
            return None
        try:
            return accept(full, bytes(self.store.get(full)), read)
        except StoreValueError:
            return None

    def stale(self, node: int, now: float) -> bool:
        """Whether ``node``'s heartbeat has not moved for `HEARTBEAT_STALE_S`."""
        count = int(self.store.add(f"{self.prefix}alive/{node}", 0))
        last = self._beats.get(node)
        if last is None or last[0] != count:
            self._beats[node] = (count, now)
            return False
        return count > 0 and now - last[1] > HEARTBEAT_STALE_S  # 0: not started yet


class Heartbeat:
    """A daemon thread that counts up ``alive/<node>`` in the store while this node decides
    (its own store connection: the deciding thread's may be busy)."""

    def __init__(self, store: Any, prefix: str, node: int) -> None:
        self._store, self._key = store, f"{prefix}alive/{node}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rs-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(HEARTBEAT_S * 4)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except (RuntimeError, OSError):
                return  # the store is gone: the deciding thread finds out on its next call
            self._stop.wait(HEARTBEAT_S)


def record_fault(store: Any, job: Job, fault: Mapping[str, Any]) -> None:
    """Supervisor hook: this node saw a backend fault mid-run; every node's supervisor reads it
    (`recorded_faults`), stops its workers and relaunches on the next candidate."""
    Channel(store, job.prefix).put(f"fault/{job.node}", {**fault, "node": job.node})


def recorded_faults(store: Any, job: Job, *, strict: bool = False) -> dict[int, dict[str, Any]]:
    """The faults the nodes recorded (`record_fault`), by node, as JSON objects
    (`read_faults` with no further check)."""
    return read_faults(store, job, lambda _node, d: d, strict=strict)


def read_faults(store: Any, job: Job, read: Callable[[int, dict[str, Any]], T], *,
                strict: bool = False) -> dict[int, T]:
    """The faults the nodes recorded (`record_fault`), by node, each through ``read`` (node,
    object); never waits for a record (each look is bounded by the store's timeout). A record
    refused (forged or malformed: not JSON, too deep, or refused by ``read``) is one logged
    line naming its key and counts as no record, never as a fault nor as a store that does
    not answer. ``strict``: a store that does not answer raises (`NodeLostError`) instead of
    reading as no record."""
    out: dict[int, T] = {}
    ch = Channel(store, job.prefix)
    for k in range(job.nodes):
        try:
            got = ch.peek_as(f"fault/{k}", functools.partial(read, k))
        except (RuntimeError, OSError) as exc:
            if strict:
                raise NodeLostError(f"the job's store at {job.store_text} did not answer: "
                                    f"{first_line(exc)}", how="store") from exc
            continue
        if got is not None:
            out[k] = got
    return out


#: The values already said refused in this process, by key (digests): one line per forged
#: value, at most `_SAID_PER_KEY` values per key and `_SAID_KEYS` keys (a writer that changes
#: its value at every look is said a few times, never once per look).
_SAID: dict[str, set[str]] = PROCESS.hold(
    "nodes.store.said", dict, "the forged store values already said, by key (digests)")
_SAID_PER_KEY = 3
_SAID_KEYS = 1024


def accept(key: str, raw: bytes, read: Callable[[dict[str, Any]], T]) -> T:
    """``read`` of the value ``raw`` at ``key``, decoded by the bounded reader; a value
    refused is said once (`refused`) and raised as `StoreValueError` naming ``key``."""
    try:
        return read(decode(raw, key))
    except StoreValueError as exc:
        refused(key, raw, exc.problem)
        raise
    except NodeLostError:
        raise
    except Exception as exc:  # the edge: whatever a reader trips on in a value someone else
        # wrote (an AttributeError, a RecursionError of a nested check) is that
        # value refused, never a traceback nor a store taken for out of reach
        problem = _short(exc)
        refused(key, raw, problem)
        raise StoreValueError(key, problem) from None


def refused(key: str, raw: bytes, problem: str) -> None:
    """One warning line for a value of the job's store this node refused, naming its key (the
    record's ``store_key``); once per key and value in this process."""
    digest = hashlib.sha256(raw).hexdigest()
    said = _SAID.get(key)
    if said is None:
        if len(_SAID) >= _SAID_KEYS:
            return
        said = _SAID[key] = set()
    if digest in said or len(said) >= _SAID_PER_KEY:
        return
    said.add(digest)
    log.warning("resilient_strategy: ignored the value at %r in the job's store (%d bytes): %s; "
                "this package never writes such a value there (another version, or a process "
                "outside the job: the store must be on a trusted network)", key, len(raw),
                problem, extra={"store_key": key})


def _as_is(d: dict[str, Any]) -> dict[str, Any]:
    return d


def _short(exc: BaseException) -> str:
    from .messages import words

    return words(str(exc) or type(exc).__name__, 300)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
