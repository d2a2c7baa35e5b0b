"""A multi-node test bed in network namespaces: real faults, injected from outside the job.

Each "node" is a network namespace with its own address and interface, joined to the others by a
veth pair through a bridge in a switch namespace of its own (the bridge side of node ``i``'s pair
is ``<prefix>-h<i>``, the node side ``<prefix>-e<i>``). Addresses are in the benchmarking range
198.18.0.0/15 (RFC 2544) and live only inside namespaces the bed created: nothing is added to the
machine's own namespace, nothing is routed off the machine. Every name starts with the prefix;
:func:`sweep` removes whatever a bed of that prefix left (run at the start of :func:`testbed`,
and on its way out, on any exit).

:class:`Job` runs ``resilient-strategy run --nnodes N`` inside each namespace
(``ip netns exec``) and watches it from outside through the files the supervisor already writes:
each attempt's ``decision.json``, the ranks' progress records and the checkpoint note (the
session directory under the node's ``TMPDIR``; copied as they appear, since the supervisor
removes its session at the end). Faults are the kernel's: signals to a worker, links set down.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not where it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient_strategy.core.values.bounded import parse_json
from resilient_strategy.records.progress import COLLECTIVE, COLLECTIVE_DONE, STEP_DONE, read_record
from resilient_strategy.records.rundir import RUN_PREFIX
from resilient_strategy.run.warm import rank_pids

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "rstb"  # every namespace, link and /etc/netns entry the bed makes starts with it
NET = "198.18.0"  # the nodes' network (/24): benchmarking range, never routed off the machine
DECOY_NET = "198.19.0"  # a decoy's network: same range, reaches nobody
PORT = 29400  # the rendezvous port on node 0 (each node has its own port space)
PROBE_S = 40.0  # --probe-timeout: the probe across nodes takes ~10 s, longer on busy cores
IP_TIMEOUT_S = 10.0  # a deadline on every `ip` command
WORKER = "resilient_strategy.run.worker"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          check=check)


def unavailable(prefix: str = PREFIX) -> str | None:
    """Why the bed cannot run here (None: it can): not root, no ``ip``, or the kernel (or the
    sandbox) refuses a network namespace."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (the bed runs as root in CI)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"{prefix}-check{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        veth = _ip("-n", name, "link", "add", f"{prefix}-cx", "type", "veth", "peer", "name",
                   f"{prefix}-cy", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run `ip`: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _ip("netns", "del", name, check=False)
    return None


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose names start with ``<prefix>-``."""
    out = _ip("netns", "list", check=False).stdout
    return sorted(n for n in (ln.split()[0] for ln in out.splitlines() if ln.strip())
                  if n.startswith(f"{prefix}-"))


def root_links(prefix: str = PREFIX) -> list[str]:
    """Links in this (the machine's) namespace whose names start with ``<prefix>-``."""
    out = _ip("-o", "link", "show", check=False).stdout
    names = (m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", out, re.MULTILINE))
    return sorted(n for n in names if n.startswith(f"{prefix}-"))


def sweep(prefix: str = PREFIX) -> None:
    """Remove everything a bed of ``prefix`` left: the processes inside its namespaces (they are
    the bed's by construction), the namespaces (their links go with them), links left in this
    namespace by an interrupted setup, and its /etc/netns entries."""
    for ns in namespaces(prefix):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
    for link in root_links(prefix):
        _ip("link", "del", link, check=False)
    for d in Path("/etc/netns").glob(f"{prefix}-*"):
        shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only when empty: another user's entries stay


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    iface: str  # the node's side of its veth pair (the link to the others)
    port: str  # the bridge's side, in the switch namespace
    address: str


@dataclass(frozen=True)
class Bed:
    prefix: str
    switch: str  # the switch namespace, holding the bridge
    nodes: tuple[Node, ...]

    @property
    def master(self) -> str:
        return self.nodes[0].address

    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[node].netns, *argv]

    def bridge_port(self, node: int, up: bool) -> None:
        """The bridge's side of the node's link: down = silent loss (the node's own link stays
        up, its sends go nowhere and nothing errors)."""
        _ip("-n", self.switch, "link", "set", self.nodes[node].port, "up" if up else "down")

    def node_link(self, node: int, up: bool) -> None:
        """The node's own side of its link: down = the node is lost (its sends fail at once)."""
        _ip("-n", self.nodes[node].netns, "link", "set", self.nodes[node].iface,
            "up" if up else "down")

    def add_decoy(self, node: int) -> str:
        """A second interface on ``node`` that holds its default route and the address its
        hostname resolves to (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over
        /etc/hosts) but reaches nobody: its peer sits unbridged in the switch namespace. The
        master stays reachable on the node's own link (a more specific route). Returns the
        decoy's name."""
        n = self.nodes[node]
        name, peer = f"{self.prefix}-d{node}", f"{self.prefix}-z{node}"
        _ip("link", "add", name, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.switch)
        _ip("link", "set", name, "netns", n.netns)
        _ip("-n", self.switch, "link", "set", peer, "up")
        # the peer is the decoy's gateway and knows no route anywhere: it answers "unreachable"
        # (as a real gateway that cannot reach the master would), so that a lookup sent its way
        # (reverse DNS) fails at once instead of timing out
        _ip("-n", self.switch, "addr", "add", f"{DECOY_NET}.1/24", "dev", peer)
        _ip("-n", self.switch, "route", "add", "unreachable", "default")
        subprocess.run(["ip", "netns", "exec", self.switch, "sh", "-c",
                        "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True,
                       timeout=IP_TIMEOUT_S, capture_output=True)
        _ip("-n", n.netns, "addr", "add", f"{DECOY_NET}.{node + 2}/24", "dev", name)
        _ip("-n", n.netns, "link", "set", name, "up")
        _ip("-n", n.netns, "route", "add", "default", "via", f"{DECOY_NET}.1", "dev", name)
        hosts = Path("/etc/netns") / n.netns / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"127.0.0.1 localhost\n{DECOY_NET}.{node + 2} {os.uname().nodename}\n",
                         encoding="utf-8")
        return name

    def blackhole_master(self, node: int) -> None:
        """A blackhole route to the master on ``node``: its packets to node 0 are dropped by
        its own kernel (a connect fails at once: ``EINVAL``), the rest of its network is
        untouched."""
        _ip("-n", self.nodes[node].netns, "route", "add", "blackhole", f"{self.master}/32")


@contextlib.contextmanager
def testbed(nodes: int = 2, prefix: str = PREFIX) -> Iterator[Bed]:
    """``nodes`` namespaces on one bridge, torn down on any exit (leftovers of an earlier bed of
    the same prefix swept first)."""
    sweep(prefix)
    switch = f"{prefix}-sw"
    made: list[Node] = []
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", f"{prefix}-br", "type", "bridge")
        _ip("-n", switch, "link", "set", f"{prefix}-br", "up")
        for i in range(nodes):
            n = Node(i, f"{prefix}-n{i}", f"{prefix}-e{i}", f"{prefix}-h{i}", f"{NET}.{i + 1}")
            _ip("netns", "add", n.netns)
            _ip("link", "add", n.port, "type", "veth", "peer", "name", n.iface)
            _ip("link", "set", n.port, "netns", switch)
            _ip("link", "set", n.iface, "netns", n.netns)
            _ip("-n", switch, "link", "set", n.port, "master", f"{prefix}-br")
            _ip("-n", switch, "link", "set", n.port, "up")
            _ip("-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.iface)
            _ip("-n", n.netns, "link", "set", n.iface, "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
            made.append(n)
        yield Bed(prefix, switch, tuple(made))
    finally:
        sweep(prefix)


# --- a job on the bed -------------------------------------------------------------------------

@dataclass(frozen=True)
class Progress:
    """One step seen in a rank-0 progress record: on which node, in which attempt, when."""

    node: int
    attempt: int
    step: int
    at: float  # time.monotonic() of this (the watching) process


@dataclass
class Capture:
    """What the watcher copied out of the nodes' supervisor sessions while they ran."""

    decisions: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # (node, n)
    checkpoints: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    first_seen: dict[tuple[int, int], float] = field(default_factory=dict)  # attempt dir seen
    progress: list[Progress] = field(default_factory=list)

    def attempts(self, node: int) -> list[int]:
        return sorted(a for n, a in self.decisions if n == node)

    def last_step(self, node: int, attempt: int) -> int:
        return max((p.step for p in self.progress if (p.node, p.attempt) == (node, attempt)),
                   default=0)

    def final_steps(self) -> int | None:
        """The optimizer-step count of the last checkpoint noted (the final save)."""
        notes = [v for _, v in sorted(self.checkpoints.items(), key=lambda kv: kv[0][1])]
        return int(notes[-1]["step"]) if notes else None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = parse_json(path.read_bytes(), str(path), allow_nan=True)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Job:
    """``resilient-strategy run --nnodes N`` on every node of ``bed``, watched from outside."""

    def __init__(self, bed: Bed, work: Path, script: Path, script_args: Sequence[str], *,
                 stall_timeout: float, probe_timeout: float = PROBE_S,
                 extra_env: Mapping[str, str] | None = None, limit_s: float = 240.0,
                 nnodes: str | None = None) -> None:
        self.bed, self.work, self.limit_s = bed, work, limit_s
        self.capture = Capture()
        self.started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                    or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
        env.pop("GLOO_SOCKET_IFNAME", None)  # the decision's to set here, the bed's to watch
        env.update({"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
                    "RESILIENT_STRATEGY_CACHE_DIR": str(work / "cache"),
                    "RESILIENT_STRATEGY_TIMEOUT": f"{probe_timeout:g}",
                    "CUDA_VISIBLE_DEVICES": "", **(extra_env or {})})
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self._env = env
        self._argv = [sys.executable, "-m", "resilient_strategy", "run", "--nnodes",
                      nnodes or str(len(bed.nodes)), "--nproc-per-node", "1", "--rdzv-backend",
                      "c10d", "--rdzv-endpoint", f"{bed.master}:{PORT}", "--rdzv-id", "bed",
                      "--stall-timeout", f"{stall_timeout:g}", "--probe-timeout",
                      f"{probe_timeout:g}", str(script), *script_args]
        for node in bed.nodes:
            self.logs.append(self.work / f"node{node.index}" / "supervisor.log")
            self.procs.append(self._start(node.index, self.logs[-1]))
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _start(self, node: int, log: Path) -> subprocess.Popen[bytes]:
        home = self.work / f"node{node}"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        argv = [*self._argv[:6], "--node-rank", str(node), *self._argv[6:]]
        with open(log, "wb") as out:
            return subprocess.Popen(
                self.bed.exec_argv(node, argv), env={**self._env, "TMPDIR": str(home / "tmp")},
                cwd=home, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def restart(self, node: int) -> None:
        """A new supervisor for ``node`` (its last one gone), with the same job id: a node
        repaired, or its replacement. Its log is ``supervisor.restart.log``."""
        self.logs[node] = self.work / f"node{node}" / "supervisor.restart.log"
        self.procs[node] = self._start(node, self.logs[node])

    # watching
    def _watch(self) -> None:
        last: dict[tuple[int, int], int] = {}
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a session removed mid-look: look again
                self.look(last)
            time.sleep(0.05)

    def look(self, last: dict[tuple[int, int], int] | None = None) -> None:
        """Copy what is new in the nodes' sessions into :attr:`capture`."""
        last = {} if last is None else last
        now = time.monotonic()
        c = self.capture
        for node in self.bed.nodes:
            # the supervisors' sessions (the node's TMPDIR is its own)
            for run_dir in (self.work / f"node{node.index}" / "tmp").glob("*/attempt*"):
                with contextlib.suppress(ValueError):
                    key = (node.index, int(run_dir.name.removeprefix("attempt")))
                    c.first_seen.setdefault(key, now)
                    if key not in c.decisions and (d := _read(run_dir / "decision.json")):
                        c.decisions[key] = d
                    if (note := _read(run_dir / "checkpoint.json")) is not None:
                        c.checkpoints[key] = note
                    rec = read_record(str(run_dir / "rank0.progress"))
                    if (rec is not None and rec.phase in _STEPS and rec.k > 0
                            and rec.k != last.get(key)):
                        last[key] = rec.k
                        c.progress.append(Progress(key[0], key[1], rec.k, now))

    def wait_for_step(self, step: int, attempt: int = 0, timeout_s: float = 120.0) -> float:
        """Until rank 0's record on some node says optimizer step ``step`` (or later) of
        ``attempt`` is done; returns when it was seen."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            seen = [p for p in list(self.capture.progress)
                    if p.attempt == attempt and p.step >= step]
            if seen:
                return seen[0].at
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.02)
        raise TimeoutError(f"step {step} of attempt {attempt} not reached: {self.tails()}")

    def workers(self, node: int, attempt: int | None = None) -> list[int]:
        """The pids of the live training workers the node's supervisor started (of one
        attempt): from the ``rank<N>.pid`` file every worker writes in its attempt's directory
        (a warm-started worker is forked from run's fork server: its command line and
        environment are the server's), else from their command lines (the run directory is
        in a fresh worker's)."""
        home = self.work / f"node{node}" / "tmp"
        pattern = f"{RUN_PREFIX}*/attempt{'*' if attempt is None else attempt}"
        found = sorted({pid for d in home.glob(pattern) for r in range(len(self.bed.nodes))
                        for pid in rank_pids(d, r)})
        if found:
            return found
        where = "" if attempt is None else f"/attempt{attempt}/"
        return [pid for pid, cmd in _processes() if WORKER in cmd and str(home) in cmd
                and where in cmd]

    def leftovers(self) -> list[str]:
        """Live processes of this job (anything whose command line names its directory)."""
        return [f"{pid} {cmd[:160]}" for pid, cmd in _processes() if str(self.work) in cmd]

    def finish(self) -> list[int]:
        """Every supervisor's exit status (each killed with its group at the job's limit)."""
        codes = []
        try:
            for p in self.procs:
                left = max(1.0, self.started + self.limit_s - time.monotonic())
                try:
                    p.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=IP_TIMEOUT_S)
                codes.append(p.returncode)
        finally:
            self.stop()
        return codes

    def history(self, node: int) -> list[dict[str, Any]]:
        """The node's supervisor's record of every attempt (``attempts.json`` in its evidence
        directory, written when there was a fault): candidate, verdict, action, exit code."""
        data = self._attempts(node)
        if data is not None and isinstance(data.get("attempts"), list):
            return [a for a in data["attempts"] if isinstance(a, dict)]
        return []

    def setup(self, node: int) -> dict[str, Any] | None:
        """What ended the node's run before its first attempt (``attempts.json``'s ``setup``:
        the nodes never agreed), None when nothing did."""
        data = self._attempts(node)
        got = None if data is None else data.get("setup")
        return got if isinstance(got, dict) else None

    def _attempts(self, node: int) -> dict[str, Any] | None:
        for path in (self.work / f"node{node}").glob(
                "resilient-strategy-evidence/*/attempts.json"):
            return _read(path)
        return None

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=IP_TIMEOUT_S)
        self._stop.set()
        self._watcher.join(timeout=IP_TIMEOUT_S)
        self.look()

    def tails(self, n: int = 3000) -> list[str]:
        return [log.read_bytes()[-n:].decode(errors="replace") if log.exists() else ""
                for log in self.logs]


_STEPS = (COLLECTIVE, COLLECTIVE_DONE, STEP_DONE)  # phases whose k is the step


def _processes() -> list[tuple[int, str]]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (proc / "stat").read_text().rsplit(") ", 1)[-1][:1]
                if state != "Z":
                    out.append((int(proc.name), cmd))
    return out


def tcp_addresses(pid: int) -> set[str]:
    """The local IPv4 addresses of process ``pid``'s TCP sockets (read in its own namespace:
    /proc/<pid>/net/tcp, matched to its descriptors by inode)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if len(f) > 9 and f[9] in inodes:
                ip_hex = f[1].split(":")[0]
                out.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


# --- faults and what came of them ---------------------------------------------------------------

#: The bed's training run: ~85 ms per optimizer step on 2 busy cores, 48 steps, a checkpoint
#: every 4 (examples/torch_train.py; global batch 256).
SAMPLES, EPOCHS, HIDDEN, EVERY = 6144, 2, 1024, 4
EXPECTED_STEPS = EPOCHS * (SAMPLES // 256)
STALL_S = 5.0  # --stall-timeout: the allowance for a wait on a peer
#: --probe-timeout of the setup-failure scenario (``blackhole``): no probe runs there, and the
#: nodes' waits for each other before the first attempt are derived from it (node 0 waits
#: 2 x max(10 s, half of it) for node 1 to join, node 1 as long for the store: 20 s each)
SETUP_PROBE_S = 10.0
FAULT_STEP = 8  # strike once rank 0 is this far
FAULTS = ("none", "sigkill", "sigstop", "link_down", "bridge_down", "straggler", "decoy",
          "blackhole")


@dataclass(frozen=True)
class Outcome:
    """What one fault came to, from typed outputs only (exit codes, decisions, progress
    records, checkpoint notes, processes, sockets)."""

    fault: str
    codes: tuple[int, ...]  # each node's supervisor's exit status
    expected_steps: int
    final_steps: int | None  # the optimizer-step count of the last checkpoint noted
    attempts: tuple[tuple[int, ...], ...]  # per node: the launch attempts it decided
    chosen: tuple[tuple[str, int], ...]  # node 0's decisions: (candidate key, nodes)
    history: tuple[Mapping[str, Any], ...]  # node 0's attempts.json: verdict, action, exit code
    fault_step: int  # the step rank 0 had done when the fault struck
    stopped_s: float | None  # fault -> the faulted attempt's workers gone on node 0
    relaunched_s: float | None  # fault -> the next attempt's decision written (node 0)
    training_again_s: float | None  # fault -> the first step of the next attempt
    leftovers: tuple[str, ...]  # processes of the job still alive after it ended
    addresses: tuple[str, ...] = ()  # local TCP addresses of node 1's worker (decoy)
    decoy: str = ""  # the decoy's address (decoy)
    ended_s: tuple[float | None, ...] = ()  # per node: fault -> its supervisor exited
    setup: tuple[Mapping[str, Any] | None, ...] = ()  # per node: attempts.json's "setup"

    @property
    def relaunched(self) -> bool:
        return len(self.attempts[0]) > 1

    @property
    def verdict(self) -> Mapping[str, Any] | None:
        """Node 0's verdict on the faulted attempt (kind, cause, step), None without a fault."""
        return self.history[0]["verdict"] if self.history else None

    @property
    def action(self) -> str | None:
        """What node 0's supervisor did after the faulted attempt (retry, step_down, stop)."""
        return str(self.history[0]["action"]) if self.history else None

    def row(self) -> dict[str, Any]:
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        v = self.verdict
        verdict = "-" if v is None else f"{v.get('kind')} ({v.get('cause') or '-'})"
        action = self.action or "none"
        if any(self.setup):  # the nodes never agreed: what each recorded (node that went silent)
            verdict = ", ".join("-" if u is None else f"{u.get('error')} ({u.get('how')}, node "
                                f"{u.get('node')})" for u in self.setup)
            action = "stop before any attempt"
        if self.relaunched:
            action += (f": {self.chosen[1][0].split(':')[1]} on {self.chosen[1][1]} node(s)")
        return {"fault": self.fault, "exit codes": ",".join(map(str, self.codes)),
                "fault at step": self.fault_step, "stopped s": s(self.stopped_s),
                "verdict (cause)": verdict, "action": action,
                "relaunch decided s": s(self.relaunched_s),
                "training again s": s(self.training_again_s),
                "steps": f"{self.final_steps or 0}/{self.expected_steps}",
                "steps equal": "- (nothing ran)" if any(self.setup)
                else self.final_steps == self.expected_steps,
                "ended s": ",".join(s(e) for e in self.ended_s),
                "leftovers": len(self.leftovers)}


def run_fault(bed: Bed, work: Path, fault: str, *, stall_s: float = STALL_S,
              limit_s: float = 240.0) -> Outcome:
    """Train on ``bed`` and strike ``fault`` at :data:`FAULT_STEP` (``none``: an
    uninterrupted run; ``decoy``: a decoy interface on node 1 from the start; ``blackhole``: a
    blackhole route to the master on node 1 from the start, so that the nodes never meet:
    times are from the start of the job). ``decoy+straggler``: both in one run (the decoy's
    addresses are read before the straggler is stopped); the other faults strike alone."""
    faults = set(fault.split("+"))
    if not faults <= set(FAULTS) or (len(faults) > 1 and faults != {"decoy", "straggler"}):
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}, or decoy+straggler")
    decoy = f"{DECOY_NET}.3" if "decoy" in faults else ""
    if decoy:
        bed.add_decoy(1)
    setup = fault == "blackhole"
    if setup:
        bed.blackhole_master(1)
    args = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--hidden", str(HIDDEN),
            "--checkpoint-every", str(EVERY), "--checkpoint-dir", str(work / "ckpt")]
    job = Job(bed, work, ROOT / "examples" / "torch_train.py", args, stall_timeout=stall_s,
              limit_s=limit_s, probe_timeout=SETUP_PROBE_S if setup else PROBE_S)
    t0: float | None = None
    stopped: float | None = None
    addresses: set[str] = set()
    victims: list[int] = []
    ended: dict[int, float] = {}
    try:
        if not setup:
            job.wait_for_step(FAULT_STEP, timeout_s=limit_s / 2)
            victims = job.workers(1, 0)
        if faults & {"sigkill", "sigstop", "straggler"}:
            assert victims, job.tails()
        t0 = job.started if setup else time.monotonic()
        if "decoy" in faults:  # first: a stopped worker's sockets are read all the same
            addresses |= {a for pid in victims for a in tcp_addresses(pid)}
        if fault == "sigkill":
            os.kill(victims[0], signal.SIGKILL)
        elif faults & {"sigstop", "straggler"}:
            os.kill(victims[0], signal.SIGSTOP)
        elif fault == "link_down":
            bed.node_link(1, up=False)
        elif fault == "bridge_down":
            bed.bridge_port(1, up=False)
        fault_step = job.capture.last_step(0, 0)
        restore_at = t0 + (stall_s / 2 if "straggler" in faults else stall_s + 1.0)
        restored = not faults & {"straggler", "bridge_down"}
        end = t0 + limit_s
        while time.monotonic() < end and any(p.poll() is None for p in job.procs):
            now = time.monotonic()
            if not restored and now >= restore_at:
                if "straggler" in faults:
                    os.kill(victims[0], signal.SIGCONT)
                else:
                    bed.bridge_port(1, up=True)
                restored = True
            if stopped is None and not job.workers(0, 0):
                stopped = now
            for i, proc in enumerate(job.procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = now
            time.sleep(0.05)
        for i, proc in enumerate(job.procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        if not restored and fault == "bridge_down":
            bed.bridge_port(1, up=True)
        codes = tuple(job.finish())
    finally:
        job.stop()
        for pid in victims:  # a stopped worker the job did not reap: never left behind stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    c = job.capture
    again = [p.at for p in c.progress if p.attempt >= 1]
    decided = c.first_seen.get((0, 1))
    base = t0 if t0 is not None else 0.0
    return Outcome(
        fault=fault, codes=codes, expected_steps=EXPECTED_STEPS, final_steps=c.final_steps(),
        attempts=tuple(tuple(c.attempts(n.index)) for n in bed.nodes),
        chosen=tuple((str(c.decisions[(0, a)]["chosen"]), int(c.decisions[(0, a)]["nodes"]))
                     for a in c.attempts(0)),
        history=tuple(job.history(0)), fault_step=fault_step,
        stopped_s=None if stopped is None or faults <= {"none", "straggler", "decoy", "blackhole"}
        else stopped - base,
        relaunched_s=None if decided is None else decided - base,
        training_again_s=min(again) - base if again else None,
        leftovers=tuple(job.leftovers()), addresses=tuple(sorted(addresses)), decoy=decoy,
        ended_s=tuple(None if i not in ended or t0 is None else ended[i] - t0
                      for i in range(len(bed.nodes))),
        setup=tuple(job.setup(n.index) for n in bed.nodes))


# --- nodes that come and go (three nodes; membership) -------------------------------------------

#: The membership scenarios' run: one epoch of 6144 samples at a global batch of 192 (divisible
#: by 1, 2 and 3 replicas): 32 optimizer steps, a checkpoint every 4.
MEMBER_BATCH, MEMBER_EPOCHS = 192, 1
MEMBER_STEPS = MEMBER_EPOCHS * (SAMPLES // MEMBER_BATCH)
MEMBER_FAULTS = ("none", "lost_node", "cut_off_start", "rejoin")


@dataclass(frozen=True)
class Membership:
    """What a node loss came to, from typed outputs only: each node's exit status, the nodes
    each attempt was decided for (``decision.json``'s ``nodes``), the nodes whose rank 0 made
    progress in each attempt, the optimizer-step count of the last checkpoint, every node's
    ``attempts.json``, and (seconds from the fault, measured from outside) when each
    supervisor exited."""

    fault: str
    codes: tuple[int, ...]
    expected_steps: int
    final_steps: int | None
    attempts: tuple[tuple[int, ...], ...]  # per node: the launch attempts it decided
    nodes_decided: tuple[tuple[int, int, int], ...]  # (node, attempt, nodes in its decision)
    trained: tuple[tuple[int, tuple[int, ...]], ...]  # (attempt, nodes whose rank 0 stepped)
    records: tuple[Mapping[str, Any] | None, ...]  # per node: its attempts.json
    ended_s: tuple[float | None, ...]
    training_again_s: float | None  # fault -> the first step of a later attempt
    leftovers: tuple[str, ...]
    #: (attempt, samples/s): the global batch times the optimizer steps per second node 0's
    #: rank 0 recorded in the attempt (None: fewer than two steps seen)
    rates: tuple[tuple[int, float | None], ...] = ()

    def history(self, node: int) -> list[Mapping[str, Any]]:
        rec = self.records[node]
        got = [] if rec is None else rec.get("attempts", [])
        return [a for a in got if isinstance(a, dict)] if isinstance(got, list) else []

    def membership(self, node: int) -> list[Mapping[str, Any]]:
        rec = self.records[node]
        got = [] if rec is None else rec.get("membership", [])
        return [m for m in got if isinstance(m, dict)] if isinstance(got, list) else []

    def row(self) -> dict[str, Any]:
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        return {"fault": self.fault, "exit codes": ",".join(map(str, self.codes)),
                "nodes training per attempt": "; ".join(
                    f"{a}: {','.join(map(str, n)) or '-'}" for a, n in self.trained),
                "training again s": s(self.training_again_s),
                "samples/s per attempt": "; ".join(
                    f"{a}: {'-' if r is None else f'{r:.0f}'}" for a, r in self.rates),
                "steps": f"{self.final_steps or 0}/{self.expected_steps}",
                "ended s": ",".join(s(e) for e in self.ended_s),
                "leftovers": len(self.leftovers)}


def run_membership(bed: Bed, work: Path, fault: str, *, nnodes: str | None = None,
                   limit_s: float = 240.0) -> Membership:
    """Train on every node of ``bed`` (``--nnodes nnodes``, default the bed's size) and strike
    ``fault``: ``lost_node``: once rank 0 has done :data:`FAULT_STEP`, the last node's
    supervisor is SIGKILLed and its link set down; ``cut_off_start``: node 1's link set down as
    soon as its first decision is written (the nodes agreed; its workers have not started);
    ``rejoin``: ``lost_node`` over four epochs, then, once the survivors train again, the last
    node's link set up and a new supervisor started there with the same job id; ``none``: an
    uninterrupted run. Times are from the fault."""
    if fault not in MEMBER_FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of {MEMBER_FAULTS}")
    epochs = 4 * MEMBER_EPOCHS if fault == "rejoin" else MEMBER_EPOCHS  # time to come back
    args = ["--samples", str(SAMPLES), "--epochs", str(epochs), "--hidden", str(HIDDEN),
            "--global-batch-size", str(MEMBER_BATCH), "--checkpoint-every", str(EVERY),
            "--checkpoint-dir", str(work / "ckpt")]
    job = Job(bed, work, ROOT / "examples" / "torch_train.py", args, stall_timeout=STALL_S,
              limit_s=limit_s, nnodes=nnodes)
    last = len(bed.nodes) - 1
    t0: float | None = None
    ended: dict[int, float] = {}
    try:
        if fault in ("lost_node", "rejoin"):
            job.wait_for_step(FAULT_STEP, timeout_s=limit_s / 2)
            t0 = time.monotonic()
            os.kill(job.procs[last].pid, signal.SIGKILL)
            bed.node_link(last, up=False)
            if fault == "rejoin":  # repaired once the survivors train again: it comes back
                job.wait_for_step(1, attempt=1, timeout_s=limit_s / 2)
                job.procs[last].wait(timeout=IP_TIMEOUT_S)
                bed.node_link(last, up=True)
                job.restart(last)
        elif fault == "cut_off_start":
            end = time.monotonic() + limit_s / 2
            while (1, 0) not in job.capture.decisions and time.monotonic() < end:
                time.sleep(0.01)
            assert (1, 0) in job.capture.decisions, job.tails()
            t0 = time.monotonic()
            bed.node_link(1, up=False)
        else:
            t0 = job.started
        end = job.started + limit_s
        while time.monotonic() < end and any(p.poll() is None for p in job.procs):
            for i, proc in enumerate(job.procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.05)
        for i, proc in enumerate(job.procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        codes = tuple(job.finish())
    finally:
        job.stop()
    c = job.capture
    trained: dict[int, set[int]] = {}
    for p in c.progress:
        trained.setdefault(p.attempt, set()).add(p.node)
    again = [p.at for p in c.progress if p.attempt >= 1]
    base = t0 if t0 is not None else job.started
    rates: list[tuple[int, float | None]] = []
    for a in sorted(trained):
        seen = [p for p in c.progress if (p.node, p.attempt) == (0, a)]
        span = seen[-1].at - seen[0].at if len(seen) > 1 else 0.0
        rates.append((a, (seen[-1].step - seen[0].step) * MEMBER_BATCH / span if span > 0
                      else None))
    return Membership(
        fault=fault, codes=codes, expected_steps=epochs * (SAMPLES // MEMBER_BATCH),
        final_steps=c.final_steps(),
        attempts=tuple(tuple(c.attempts(n.index)) for n in bed.nodes),
        nodes_decided=tuple(sorted((n, a, int(d.get("nodes", 0)))
                                   for (n, a), d in c.decisions.items())),
        trained=tuple((a, tuple(sorted(n))) for a, n in sorted(trained.items())),
        records=tuple(job._attempts(n.index) for n in bed.nodes),
        ended_s=tuple(None if i not in ended else ended[i] - base
                      for i in range(len(bed.nodes))),
        training_again_s=min(again) - base if again else None,
        leftovers=tuple(job.leftovers()), rates=tuple(rates))
