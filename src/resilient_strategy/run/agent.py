"""One attempt, through torch's elastic agent: a `LocalElasticAgent` subclass starts the
workers of one decision, adds the progress watch to its monitoring loop (`AttemptMonitor`,
torch-free), and stops every worker (a stopped one SIGKILLed at once: `prepare_stop`; the others
SIGTERM, its shutdown timeout, SIGKILL) when the group is unhealthy. The protected members of
torch's agent it reaches are isolated here (`SupervisedHooks`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.call.options import DEFAULT_PROCESS_GROUP_TIMEOUT, RunOptions
from ..core.values.bounded import parse_json
from ..core.values.candidate import CandidateKey
from ..errors import UnsafePathError
from ..machine import env as machine_env
from ..machine import files, procs
from ..probing.proc import SHM_PREFIXES, reap_shm, shm_entries
from ..process import PROCESS
from ..records import flight, phases
from ..records.flightdump import DumpStatus, RankDump, analyse, divergence
from ..records.handoff import HandedDecision
from ..records.progress import (
    FINISHED,
    Stall,
    read_record,
)
from ..records.rundir import RunDir

if TYPE_CHECKING:
    from .peers import PeerWatch

from .cmdline import node_count, parser
from .verdicts import (
    SEEN_ERROR_RECORD,
    SEEN_EXIT,
    SEEN_PEER,
    SEEN_STALL,
    PeerFault,
    RankExit,
    Verdict,
    VerdictKind,
    classify_attempt,
    diverged,
    memory_killed,
    step_in_progress,
)
from .warm import START_METHOD, applies, start_server
from .watch import TrainingWatch, stopped_reason, torch_timeouts

log = logging.getLogger("resilient_strategy")
T = TypeVar("T")


def launch(opts: RunOptions, decision: HandedDecision, env: Mapping[str, str],
            session: Path, peer: PeerWatch | None = None, *, alone: bool = False,
            switch: Callable[[], int | None] | None = None) -> Verdict:
    """One attempt. ``peer``: the other nodes' fault records, watched while the workers run;
    ``alone``: node 0 of a multi-node run trains by itself (one node, its own rendezvous);
    ``switch``: asked in the monitoring loop, a checkpoint step when the supervisor stops the
    healthy group there for a measured switch (a ``switch`` verdict at that step).
    Whatever torch and multiprocessing name through ``tempfile`` in this process meanwhile
    lives in the session's private directory (`private_tempdir`)."""
    with private_tempdir(session / TORCH_TEMP):
        return _launch(opts, decision, env, session, peer, alone=alone, switch=switch)


#: The directory of the session (``<session>/torch-tmp``, 0700) that this process's
#: ``tempfile`` names while an attempt runs (`private_tempdir`).
TORCH_TEMP = "torch-tmp"


@contextlib.contextmanager
def private_tempdir(directory: Path) -> Iterator[Path]:
    """Within the block, this process's ``tempfile`` directory (``tempfile.tempdir``, never
    the ``TMPDIR`` of the workers) is ``directory``: made 0700 when absent, and checked as a
    checkpoint's directory is (this user's, not a symlink, writable by nobody else; its parent,
    the session, too). torch names in it what it makes for the ranks of an attempt with
    ``tempfile`` in the supervisor: ``start_processes``'s error file of each rank (the warm
    start), which it unlinks, keeps the name of and ``pickle.load``s on a rank's non-zero
    exit, so that in a shared (sticky) TMPDIR another user could plant a pickle there that
    runs as this user; its agent's default log directory (``torchelastic_*``), its file timer's
    FIFO (``watchdog_timer_*``), a file store of the rendezvous, multiprocessing's own
    directory (``pymp-*``). The previous directory is restored after (also None: ``tempfile``
    reads TMPDIR again). Raises `resilient_strategy.errors.UnsafePathError` when it is not
    private."""
    from ..machine.files import check_private_dir, ensure_private_dir, writing

    check_private_dir(directory.parent, follow_links=False)
    with writing(directory, "the run's directory"):
        ensure_private_dir(directory)
    check_private_dir(directory, follow_links=False)
    before = tempfile.tempdir
    tempfile.tempdir = str(directory)
    try:
        yield directory
    finally:
        tempfile.tempdir = before


def tail_regular_file(header: str, file: str, dst: Any, finished: Any, interval_sec: float,
                      log_line_filter: Callable[[str], bool] | None = None) -> None:
    """torch's ``tail_logfile`` (``--tee``: a rank's stderr.log copied to the console), but
    opening only a regular file of this user's own, never through a symlink, never blocking:
    torch's own ``open(file)`` of a FIFO found at that name waits for a writer forever, and so
    does the supervisor, whose ``TailLog.stop`` joins every tailer at the attempt's end. Such a
    file is said once and not copied (the rank's evidence skips it too: `RunDir.stderr_logs`).
    """
    while True:
        try:
            fp = files.open_regular(Path(file))
            break
        except FileNotFoundError:
            if finished.is_set():
                return
            time.sleep(interval_sec)
        except (UnsafePathError, OSError) as exc:
            files.warn_once(f"tail:{file}", f"not copying a rank's log to the console: {exc}")
            return
    with fp:
        while True:
            line = fp.readline()
            if line:
                if log_line_filter is None or log_line_filter(line):
                    dst.write(f"{header}{line}")
            elif finished.is_set():
                return
            else:
                time.sleep(interval_sec)


@contextlib.contextmanager
def regular_tails() -> Iterator[None]:
    """Within the block, torch's agent tails its ranks' logs with `tail_regular_file` (its
    ``TailLog`` submits the module's ``tail_logfile`` when the workers start); torch's own
    function is put back after."""
    from torch.distributed.elastic.multiprocessing import tail_log

    before = tail_log.tail_logfile
    tail_log.tail_logfile = tail_regular_file
    try:
        yield
    finally:
        tail_log.tail_logfile = before


def _launch(opts: RunOptions, decision: HandedDecision, env: Mapping[str, str],
            session: Path, peer: PeerWatch | None, *, alone: bool,
            switch: Callable[[], int | None] | None = None) -> Verdict:
    """`launch`'s attempt: torchrun's configuration (`torchrun_namespace`), the rendezvous
    (`rendezvous_handler`), the agent run (`run_agent`), its verdict (`attempt_verdict`)."""
    run_dir = Path(decision.run_dir)
    where = RunDir(run_dir)
    marks = where.supervisor_phases
    phases.mark(marks, phases.AGENT_STARTED)
    nproc = decision.processes
    watch = TrainingWatch([str(where.progress(r)) for r in range(nproc)],
                          opts.stall_timeout_s, busy_s=opts.busy_timeout_s)
    monitor = AttemptMonitor(watch, peer, run_dir, nproc, switch)
    agent_cls = _agent_class()
    warm = opts.warm_start and applies(decision.framework)
    if warm:  # once per supervisor, before this attempt sets its own variables; its files in
        # "rs-run-<pid>-m" beside the session "rs-run-<pid>-XXXX" (swept as the session is)
        start_server(session.with_name(session.name.rpartition("-")[0] + "-m"))
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    ns, nnodes = torchrun_namespace(opts, decision, peer, alone=alone)
    before = machine_env.snapshot()  # torchrun sets OMP_NUM_THREADS: ours to remove again
    try:
        config, _, _ = torchrun.config_from_args(ns)
    finally:
        if nproc == 1:
            machine_env.unset_added(TORCHRUN_VARS, before)
    try:  # its store client connects to the endpoint: a node cut off waits here, watched
        handler, master_addr, master_port = rendezvous_handler(config, nnodes, peer)
    except LeftRendezvous as left:
        machine_env.unset_added(TORCHRUN_VARS, before)
        phases.mark(marks, phases.WORKERS_STOPPED)
        return _peer_verdict(left.fault, peer)
    entrypoint, worker_args = worker_entry(run_dir, opts, warm)
    spec = WorkerSpec(
        role=config.role, local_world_size=nproc, entrypoint=entrypoint, args=worker_args,
        rdzv_handler=handler, max_restarts=0,
        monitor_interval=config.monitor_interval, master_addr=master_addr,
        master_port=master_port, local_addr=config.local_addr)
    agent = agent_cls(spec=spec, logs_specs=config.logs_specs,
                      start_method=START_METHOD if warm else config.start_method,
                      monitor=monitor, warm=warm, **shutdown_grace(config))
    from ..machine.versions import detect_frameworks

    torch_version = detect_frameworks()[0].version  # metadata: the name this torch expects
    # the workers inherit these for the attempt; never one the user set
    shm_before = shm_entries(SHM_DIR, ATTEMPT_SHM_PREFIXES)
    oom_before = procs.oom_kills()  # the kernel's OOM kills so far (the evidence of a SIGKILL)
    with machine_env.setting(worker_env(decision, opts, watch.busy_s, env, torch_version)):
        try:
            result = run_agent(agent, monitor, where, spec.rdzv_handler, shm_before)
        finally:
            machine_env.unset_added(TORCHRUN_VARS, before)
    return attempt_verdict(where, monitor, result, oom_before, world=nnodes * monitor.nproc)


def torchrun_namespace(opts: RunOptions, decision: HandedDecision, peer: PeerWatch | None, *,
                       alone: bool) -> tuple[argparse.Namespace, int]:
    """torchrun's arguments for one attempt (the user's, or the script's alone) as the agent
    of this supervisor runs it: ``decision``'s process count, no restart of torch's own (a
    relaunch is ours, on another candidate), the logs in the attempt's directory, stderr teed
    to a file we can read; one node by itself when ``alone``, else the attempt's nodes and this
    node's rank among them; a rendezvous id of the attempt's own. Also the node count."""
    ns = argparse.Namespace(**vars(opts.torchrun or parser().parse_args([opts.script])))
    ns.nproc_per_node = str(decision.processes)
    ns.max_restarts = 0  # a relaunch is ours, on another candidate
    ns.log_dir = str(RunDir(Path(decision.run_dir)).logs)
    if str(getattr(ns, "redirects", "0") or "0") == "0" and str(getattr(ns, "tee", "0")
                                                                or "0") == "0":
        ns.tee = "2"  # stderr to the console and to a file we can read (torch's default: "0")
    nnodes = node_count(opts)
    if alone:
        ns.nnodes, ns.node_rank, ns.rdzv_conf, ns.standalone = "1", 0, "", True
        nnodes = 1
    elif nnodes > 1:  # torch's rendezvous for the nodes of this attempt (the membership round)
        nnodes = max(1, decision.nodes)
        ns.nnodes = str(nnodes)
        if peer is not None:
            ns.node_rank = peer.link.position
    if getattr(ns, "standalone", False) or (nnodes == 1 and not ns.rdzv_endpoint
                                            and ns.rdzv_backend == "static"
                                            and ns.master_port is None):
        ns.rdzv_backend, ns.rdzv_endpoint = "c10d", "localhost:0"
        ns.rdzv_id = str(uuid.uuid4())
    elif ns.rdzv_id == "none" or not ns.rdzv_id:
        ns.rdzv_id = f"resilient-strategy-{decision.attempt}"
    else:
        ns.rdzv_id = f"{ns.rdzv_id}-attempt{decision.attempt}"
    if ns.master_port is None:
        ns.master_port = 29500
    if nnodes > 1 and not getattr(ns, "local_addr", None) and ns.rdzv_endpoint:
        # the address the other nodes reach this one at, not the FQDN c10d would advertise as
        # MASTER_ADDR (a hostname that resolves to 127.0.1.1 sends the workers home)
        from ..nodes.routes import route_address

        ns.local_addr = route_address(str(ns.rdzv_endpoint).rpartition(":")[0].strip("[]"))
    return ns, nnodes


def rendezvous_handler(config: Any, nnodes: int,
                       peer: PeerWatch | None) -> tuple[Any, str | None, int | None]:
    """torch's rendezvous handler for torchrun's launch ``config`` (its join bounded across
    nodes: `bounded_join`; its membership fixed: `fixed_membership`), made while ``peer`` is
    watched (`watched`: raises `LeftRendezvous`), and the static backend's master address and
    port (else None)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    rdzv = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **bounded_join(config.rdzv_configs, nnodes))
    master_addr = master_port = None
    if rdzv.backend == "static":
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        master_addr, master_port = parse_rendezvous_endpoint(rdzv.endpoint, default_port=-1)
    handler = watched(lambda: rdzv_registry.get_rendezvous_handler(rdzv), peer)
    fixed_membership(handler)
    return handler, master_addr, master_port


def worker_entry(run_dir: Path, opts: RunOptions, warm: bool) -> tuple[Any, tuple[str, ...]]:
    """The workers' entry point and arguments: this Python running `resilient_strategy.run.
    worker` on the user's script, or (``warm``) the worker as a function, forked from the fork
    server (run/warm.py)."""
    worker_args: tuple[str, ...] = ("--supervisor", str(os.getpid()),
                                    str(run_dir / "decision.json"), opts.script,
                                    *opts.script_args)
    if warm:
        from .worker import warm_main

        return warm_main, worker_args
    return sys.executable, ("-u", "-m", "resilient_strategy.run.worker", *worker_args)


def run_agent(agent: Any, monitor: AttemptMonitor, where: RunDir, rdzv_handler: Any,
              shm_before: frozenset[str]) -> Any:
    """``agent.run()`` with its ranks' logs tailed by `tail_regular_file`: torch's run result,
    or None when the rendezvous was left for another node's fault (a torch without a quiet
    rendezvous exit raises). Then, whatever happened, what the ranks left is swept
    (`sweep_attempt`) and the rendezvous shut down (bounded; not at all when the store is out
    of reach)."""
    try:
        try:
            with regular_tails():
                result = agent.run()
        except Exception as exc:  # a torch without a quiet rendezvous exit raises it
            if monitor.peer_fault is None or type(exc).__name__ == "SignalException":
                raise
            result = None
        phases.mark(where.supervisor_phases, phases.WORKERS_STOPPED)
    finally:
        with contextlib.suppress(Exception):  # what the ranks left never stops the stop
            sweep_attempt(monitor.rank_pids, str(where.decision), shm_before)
        if monitor.peer is None or monitor.peer.reachable():  # a store gone quiet: not forever
            within(rdzv_handler.shutdown, RDZV_SHUTDOWN_S)
    return result


def attempt_verdict(where: RunDir, monitor: AttemptMonitor, result: Any,
                    oom_before: int | None, world: int = 0) -> Verdict:
    """The verdict of an attempt whose agent ended with ``result`` (torch's run result, or
    None), from what ``monitor`` saw and what the ranks left in ``where``: another node's
    fault, a measured switch, a stall (unless a rank raised before it: `raised_before`), the
    ranks' exits (`rank_exits`); the kernel's OOM kills since ``oom_before``, the flight
    recorder's dumps of a stalled group (``world``: the attempt's ranks, the default group's
    members where a dump does not name them)."""
    nproc = monitor.nproc
    if monitor.peer_fault is not None:  # another node saw the fault: this node stopped for it
        heard = _peer_verdict(monitor.peer_fault, monitor.peer)
        if heard.step:
            return heard
        return replace(heard, step=step_in_progress(  # where this node's ranks were
            [read_record(str(where.progress(lr))) for lr in range(nproc)]))
    if (monitor.switched is not None and first_raised(where, nproc) is None
            and not all((r := read_record(str(where.progress(lr)))) is not None
                        and r.phase == FINISHED for lr in range(nproc))):
        return Verdict(VerdictKind.SWITCH, "stopped at the checkpoint of step "
                       f"{monitor.switched} for a measured switch", monitor.switched)
    stall: Stall | None = monitor.stall
    if stall is not None and raised_before(
            [_read_json(where.error(lr)) for lr in range(nproc)], monitor.stall_at):
        stall = None  # a rank raised and had not exited yet: its error is the story, not a stall
    exits = [] if stall is not None else rank_exits(where, nproc, result)
    if stall is None and not exits and (result is None or result.state.name != "SUCCEEDED"):
        state = "no state (the rendezvous ended)" if result is None else result.state.name
        return Verdict(VerdictKind.EXIT, f"the workers ended in state {state}")
    # finished only when every rank wrote "finished" after its last step (exit 0 is not enough)
    records = [read_record(str(where.progress(lr))) for lr in range(nproc)]
    verdict = classify_attempt(stall, exits, records)
    if stall is None and oom_before is not None and (oom_now := procs.oom_kills()) is not None:
        verdict = memory_killed(verdict, exits, oom_now - oom_before)
    if stall is not None and monitor.flight:
        verdict = replace(verdict, flight=analyse(monitor.flight, world=world))
        if proof := divergence(monitor.flight):
            verdict = diverged(verdict, proof)
    if not verdict.ok:
        verdict = replace(verdict, seen=SEEN_ERROR_RECORD if monitor.raised is not None
                          else SEEN_STALL if stall is not None else SEEN_EXIT)
    return verdict


def rank_exits(where: RunDir, nproc: int, result: Any) -> list[RankExit]:
    """The ranks that failed in torch's run ``result`` (their exit codes), then those that
    raised (an error record) but were stopped before the agent saw them exit (exit code 1),
    each with its error record, progress record and stderr's tail."""
    exits: list[RankExit] = []
    for failure in (result.failures.values() if result is not None and result.is_failed()
                    else ()):
        lr = failure.local_rank
        exits.append(RankExit(
            rank=lr, exitcode=failure.exitcode, error=_read_json(where.error(lr)),
            record=read_record(str(where.progress(lr))),
            stderr_tail=_stderr_tail(where, lr)))
    seen = {e.rank for e in exits}
    for lr in range(nproc):
        err = _read_json(where.error(lr))
        if lr not in seen and err is not None:
            exits.append(RankExit(rank=lr, exitcode=1, error=err,
                                  record=read_record(str(where.progress(lr))),
                                  stderr_tail=_stderr_tail(where, lr)))
    return exits


#: Where the ranks' shared memory lives, and the names an attempt leaves there when its
#: processes are killed: torch's tensors shared between a DataLoader's workers and the rank
#: (``torch_*``), multiprocessing's named semaphores (``sem.mp-*``: a queue's, held by a
#: process killed before it unlinked them), NCCL's segments (``nccl-*``).
SHM_DIR = "/dev/shm"
ATTEMPT_SHM_PREFIXES = ("torch_", "sem.mp-", *SHM_PREFIXES)
#: How long the processes an attempt left are waited for once killed (they hold shared memory
#: mapped until they are gone).
SWEEP_WAIT_S = 10.0


def left_behind(sessions: Iterable[int], decision: str, root: str = "/proc") -> list[int]:
    """The live processes of this user that an attempt's ranks started and left: every process
    of a rank's session (each rank leads one: torch starts a cold worker with
    ``start_new_session``, a warm one calls ``setsid``; what it forked or spawned stays in it,
    orphaned or not) and every process started with the attempt's decision in its environment
    (``RESILIENT_STRATEGY_DECISION``: one that left the session); never this process."""
    from ..records.handoff import DECISION_VAR

    found = set(procs.session_members(sessions, root, spare=(os.getpid(),)))
    found.update(procs.pids_with_env({DECISION_VAR: decision}, root))
    found.discard(os.getpid())
    mine = []
    for pid in sorted(found):
        with contextlib.suppress(OSError):
            if os.stat(f"{root}/{pid}").st_uid == os.getuid():
                mine.append(pid)
    return mine


def sweep_attempt(sessions: Iterable[int], decision: str, shm_before: frozenset[str],
                  shm_dir: str = SHM_DIR, wait_s: float = SWEEP_WAIT_S) -> tuple[list[int],
                                                                               list[str]]:
    """After an attempt's workers were stopped: SIGKILL what its ranks left running
    (`left_behind`: DataLoader workers, a fork server, a resource tracker, anything the script
    started), wait for them to be gone (at most ``wait_s``), then remove the shared-memory
    entries of this user that appeared in ``shm_dir`` during the attempt and that no live
    process maps or holds (`probing.proc.reap_shm`, as after a probe). Returns (the pids killed,
    the entries removed)."""
    sessions = list(sessions)
    killed = left_behind(sessions, decision)
    for pid in killed:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    until = time.monotonic() + wait_s
    while killed and time.monotonic() < until and any(
            (i := procs.read_ids(pid)) is not None and not i.gone for pid in killed):
        time.sleep(0.05)
    removed = reap_shm(shm_dir, shm_before, ATTEMPT_SHM_PREFIXES)
    if killed or removed:
        log.info("the attempt left %d process(es) running (killed: %s) and %d shared-memory "
                 "entries (removed)", len(killed), ", ".join(map(str, killed)), len(removed))
    return killed, removed


def first_raised(run_dir: Path | RunDir, nproc: int) -> int | None:
    """The lowest local rank that left an error record in this attempt's directory (it raised:
    the worker writes the record before any barrier or teardown), or None."""
    return next((lr for lr in range(nproc) if RunDir.of(run_dir).error(lr).exists()), None)


def _peer_verdict(fault: PeerFault, peer: PeerWatch | None) -> Verdict:
    """This node's verdict when it stopped for ``fault``: its own when it is cut off from the
    store, else the other node's fault as seen here."""
    if peer is not None and fault.node == peer.link.node:
        own: Verdict = fault.verdict  # this node is cut off from the store
        return own
    relayed: Verdict = replace(fault.as_seen_here(), seen=SEEN_PEER)
    return relayed


class LeftRendezvous(Exception):
    """A wait on the job's store was left for what the peer watch saw (``fault``)."""

    def __init__(self, fault: PeerFault) -> None:
        super().__init__(fault.verdict.summary)
        self.fault = fault


def watched(call: Callable[[], T], peer: PeerWatch | None) -> T:
    """``call()`` (a wait on the job's store that torch bounds only by its own timeouts, a
    minute or more) in a daemon thread of its own while this one polls ``peer``: a node cut
    off, or another node of the attempt gone silent, ends the wait within the heartbeat window
    (`LeftRendezvous`; the thread is left to its own timeout). Without ``peer``: a plain
    call."""
    if peer is None:
        return call()
    import threading

    done = threading.Event()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # handed to the caller's thread below
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="rs-store-wait", daemon=True).start()
    while not done.wait(RDZV_POLL_S):
        fault = peer.poll()
        if fault is not None:
            raise LeftRendezvous(fault)
    ok, value = box[0]
    if not ok:
        raise value
    out: T = value
    return out


#: What torchrun's `config_from_args` sets in our own environment for its workers.
TORCHRUN_VARS = ("OMP_NUM_THREADS",)


def worker_env(decision: HandedDecision, opts: RunOptions, busy_s: float, env: Mapping[str, str],
               torch_version: str | None) -> dict[str, str]:
    """The variables an attempt's workers get from the supervisor (never one the user set, in
    ``env``): the training's timeouts just above the watch's, and NCCL's flight recorder on
    for a decision over NCCL, sharded (FSDP) or not (its dump is asked for before a stalled
    group is stopped)."""
    out = torch_timeouts(opts.stall_timeout_s, env, DEFAULT_PROCESS_GROUP_TIMEOUT, busy_s,
                         decision.framework)
    out.update(flight.buffer_env(_backend(decision.chosen), env, torch_version))
    return out


def _backend(key: str) -> str:
    """A candidate key's backend (``torch:nccl/fsdp:0,1`` -> ``nccl``: the marks of a sharded
    or node-0 candidate are not part of its backend)."""
    parsed = CandidateKey.read(key)
    return key if parsed is None else parsed.backend


#: How long a node waits for the others in an attempt's rendezvous, across nodes. The nodes have
#: already agreed on the attempt through the job's store before any of them starts its agent, so
#: they arrive within seconds; torch's default (600 s) let a node cut off between the agreement
#: and the rendezvous hold the others for ten minutes. The user's ``--rdzv-conf join_timeout=``
#: wins.
RDZV_JOIN_S = 120


def bounded_join(rdzv_configs: dict[str, Any], nnodes: int) -> dict[str, Any]:
    """The rendezvous configuration with `RDZV_JOIN_S` as its ``join_timeout`` across
    nodes, unless the user set one."""
    out = dict(rdzv_configs)
    if nnodes > 1 and "join_timeout" not in out:
        out["join_timeout"] = str(RDZV_JOIN_S)
    return out


#: How often the agent's thread looks at the peer watch while torch's rendezvous runs.
RDZV_POLL_S = 0.1


def rendezvous_exit(why: str) -> Exception:
    """The error with which torch's agent ends a rendezvous quietly (no worker started, no
    result): ``RendezvousGracefulExitError`` where torch has it."""
    from torch.distributed.elastic.rendezvous import api as rdzv_api

    cls = getattr(rdzv_api, "RendezvousGracefulExitError", None)
    return cls(why) if cls is not None else RuntimeError(why)


#: The longest the rendezvous's shutdown (a write to the job's store) may take.
RDZV_SHUTDOWN_S = 5.0


def fixed_membership(handler: Any) -> None:
    """Torch's agent asks the rendezvous on every turn of its monitoring loop how many nodes
    wait to join (a read from the job's store, blocking up to the c10d backend's 60 s read
    timeout when the store is unreachable), and restarts the workers in place for one. A
    supervised job has a fixed node count and a rendezvous of its own per launch attempt (a
    relaunch is a new attempt, agreed between the supervisors): no node ever waits to join it,
    and the loop never blocks on the store (the supervisor's own watch, `peers`, sees a
    store gone quiet, with a deadline)."""
    handler.num_nodes_waiting = _no_node_waits


def _no_node_waits() -> int:
    return 0


def within(call: Any, deadline_s: float) -> bool:
    """Run ``call()`` in a daemon thread for at most ``deadline_s`` seconds; whether it
    returned in time (its exceptions are swallowed: a best-effort cleanup)."""
    import threading

    def run() -> None:
        with contextlib.suppress(Exception):
            call()

    t = threading.Thread(target=run, name="rs-bounded", daemon=True)
    t.start()
    t.join(deadline_s)
    return not t.is_alive()


def raised_before(errors: list[dict[str, Any] | None], stopped_at: float) -> bool:
    """Whether a rank's error record (``at``: its wall time) was written before the group was
    stopped at ``stopped_at``: an error raised after is what the stop did to it (a tool's own
    SIGTERM handler, such as Lightning's, turns the stop into a peer's "connection closed"), not
    the story. A record without a time counts as before."""
    for err in errors:
        if err is None:
            continue
        at = err.get("at")
        if not isinstance(at, (int, float)) or at < stopped_at:
            return True
    return False


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        # a regular file only (a FIFO planted there must not block the supervisor), bounded
        data = parse_json(files.read_bytes(path, max_bytes=files.MAX_REPORT_BYTES, owned=False),
                          str(path), allow_nan=True)
    except (OSError, ValueError, UnsafePathError):
        return None
    return data if isinstance(data, dict) else None


def _stderr_tail(run_dir: Path | RunDir, local_rank: int, limit: int = 8192) -> str:
    for path in RunDir.of(run_dir).stderr_logs(local_rank):
        with contextlib.suppress(OSError, UnsafePathError):
            return files.read_tail(path, max_bytes=limit, owned=False).decode("utf-8", "replace")
    return ""


#: The most the workers get to write their Python stacks (SIGUSR1, faulthandler) before a
#: stalled group is stopped; the wait ends as soon as every rank's file is written.
STACKS_WAIT_S = 1.0
#: How often the stacks files are looked at while waiting for them.
STACKS_POLL_S = 0.01


def dump_flight(run_dir: Path, ranks: list[tuple[int, int]],
                pids: Mapping[int, int] | None = None) -> list[RankDump]:
    """Ask each worker (``(local_rank, rank)``) for torch's flight-recorder dump
    (`resilient_strategy.records.flight.request`, bounded by its deadline; every rank asked
    at once); a rank whose process (``pids``: each local rank's) is stopped is not asked nor
    waited for. What did not come is said in the result and logged, never raised."""
    got = flight.request(run_dir, ranks, stopped=stopped_reason(pids or {}))
    missing = [f"rank {r.rank}: {r.status.value} ({r.reason})" for r in got
               if r.status is not DumpStatus.DUMPED]
    if missing:
        log.info("flight recorder: no dump from %s", "; ".join(missing))
    return got


def dump_stacks(pids: Mapping[int, int], run_dir: Path | None,
                wait_s: float = STACKS_WAIT_S) -> list[int]:
    """Ask each worker (``{local_rank: pid}``) for its Python stacks (`worker` registers
    faulthandler on SIGUSR1, written to its ``rank<N>.stacks.txt`` in ``run_dir``), then wait
    until every file asked for is written (not empty, and the same size over one poll), at most
    ``wait_s`` (without ``run_dir``: ``wait_s``). Returns the local ranks whose stacks did not
    come in time (a worker already gone is not waited for, and a stopped one, state T or t,
    which cannot write until continued, is neither asked nor waited for: its state is its
    evidence)."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or not pids:
        return []
    held = stopped_reason(pids)
    asked: list[int] = []
    for lr, pid in pids.items():
        if held(lr):
            continue
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
            asked.append(lr)
    deadline = time.monotonic() + wait_s
    if run_dir is None:
        time.sleep(wait_s)
        return []
    sizes: dict[int, int] = {}
    pending = list(asked)
    while pending:
        time.sleep(STACKS_POLL_S)
        for lr in list(pending):
            try:
                size = RunDir(run_dir).stacks(lr).stat().st_size
            except OSError:
                size = 0
            # written and settled, or stopped since it was asked (it cannot write)
            if (size > 0 and sizes.get(lr) == size) or held(lr):
                pending.remove(lr)
            sizes[lr] = size
        if time.monotonic() >= deadline:
            break
    return pending


def stop_stopped(pids: Mapping[int, int]) -> list[int]:
    """SIGKILL every worker (``{local_rank: pid}``) whose process is stopped (state T or t:
    ``SIGSTOP``, a debugger), at once: a stopped process holds a SIGTERM pending until it is
    continued, and continued it would run on (a step, a record, a collective) before the
    signal took it, for nothing: its peers are being stopped. The others are left to the
    agent's SIGTERM and grace. Returns the local ranks killed."""
    held = stopped_reason(pids)
    killed = []
    for lr, pid in pids.items():
        if held(lr):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(lr)
    return killed


#: The agent class, built once per process after torch is imported (`_agent_class`): a
#: cache of a class, not state of a run.
_AGENT: list[type[Any]] = PROCESS.hold("run.agent.agent_class", list, "the agent class")


def _method_name(depth: int = 2) -> str:
    """What ``inspect.stack()[depth].function`` says, from the frame alone."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def _cheap_method_names() -> None:
    """torch's c10d rendezvous names each of its event records after its caller through
    ``inspect.stack()``, which reads the source of every frame: 9 calls per attempt cost this
    supervisor 0.3-0.7 s of each relaunch on a loaded 2-core machine (cProfile). The same name
    from the frame (this process only; the workers never rendezvous). Left alone when torch
    no longer has it."""
    with contextlib.suppress(ImportError):
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        name = getattr(dr, "get_method_name", None)
        if name is not None and getattr(name, "__module__", "") == dr.__name__:
            dr.get_method_name = _method_name


def shutdown_grace(config: Any) -> dict[str, int]:
    """The agent's stop grace (SIGTERM, this long, SIGKILL) as torchrun's launch config has it
    (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default), for an agent that takes
    it; nothing (the agent's own 30 s) on an older torch."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    grace = getattr(config, "shutdown_timeout", None)
    if grace is None or "shutdown_timeout" not in inspect.signature(LocalElasticAgent).parameters:
        return {}
    return {"shutdown_timeout": int(grace)}


def _failed_from_exit_codes(worker_group: Any, procs: list[Any]) -> Any:
    """A failed round of forked workers, from their exit codes alone (no error file)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {w.global_rank: ProcessFailure(w.local_rank, p.pid, p.exitcode, "")
                for w, p in zip(worker_group.workers, procs, strict=False)
                if p.exitcode not in (None, 0)}
    return RunResult(state=WorkerState.FAILED, failures=failures)


def prepare_stop(pids: Mapping[int, int]) -> list[int]:
    """What comes first when an attempt's group is stopped (``{local_rank: pid}``): a stopped
    worker (SIGSTOP, a debugger, a shell's job control) would hold the agent's SIGTERM pending
    for the whole grace (30 s) while the other nodes' supervisors wait for this one at the next
    agreement: killed at once (`stop_stopped`); every other is continued (one stopped since)
    so that it gets the signal now. Returns the local ranks killed."""
    killed: list[int] = []
    with contextlib.suppress(Exception):
        killed = stop_stopped(pids)
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
    return killed


def stop_grace(args: tuple[Any, ...], kwargs: dict[str, Any], takes_timeout: bool,
               grace: int) -> dict[str, Any]:
    """The keyword arguments of torch's agent's ``_shutdown(*args, **kwargs)`` with the
    configured ``grace`` as its timeout when torch gave none: torch's agent stops an unhealthy
    group with its default grace (30 s), not the configured one (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    --shutdown-timeout). An agent whose ``_shutdown`` takes no timeout (torch 2.11's: not
    ``takes_timeout``) keeps its own, as before."""
    if takes_timeout and len(args) < 2 and "timeout" not in kwargs:
        return {**kwargs, "timeout": grace}
    return kwargs


def finished_without_values(exitcodes: list[int | None], returned: set[int]) -> bool:
    """Whether forked workers (their ``exitcodes`` in local rank order; ``returned``: the local
    ranks that handed torch a return value) are all done although one exited 0 without handing
    back a value (the script's ``os._exit(0)``), which would keep torch waiting for it forever
    (and the workers that did hand theirs back waiting for torch)."""
    exited = {i for i, code in enumerate(exitcodes) if code == 0}
    return bool(exited - returned) and len(exited | returned) == len(exitcodes)


@dataclass
class AttemptMonitor:
    """The checks the agent's monitoring loop adds to torch's look at its workers, and what they
    saw (read by `attempt_verdict`); no torch here: each check says whether the group is to be
    stopped. ``watch``: the ranks' progress (`TrainingWatch.poll`); ``peer``: the other nodes'
    fault records; ``switch``: `launch`'s measured switch, asked for a checkpoint step."""

    watch: TrainingWatch
    peer: PeerWatch | None = None
    run_dir: Path | None = None
    nproc: int = 0
    switch: Callable[[], int | None] | None = None
    #: the local rank whose error record stopped the group (it raised), if one did
    raised: int | None = None
    stall: Stall | None = None
    stall_at: float = float("inf")
    peer_fault: PeerFault | None = None
    flight: list[RankDump] = field(default_factory=list)
    #: every rank process this attempt started (each leads a session of its own)
    rank_pids: set[int] = field(default_factory=set)
    #: the checkpoint step the measured switch stopped the group at
    switched: int | None = None

    def mark(self, phase: str, at: float | None = None) -> None:
        """``phase`` in the attempt's supervisor phase marks (none without a run directory)."""
        if self.run_dir is not None:
            phases.mark(RunDir(self.run_dir).supervisor_phases, phase, at)

    def started(self, pids: Mapping[int, int]) -> None:
        """The workers (``{local_rank: pid}``) started: each leads a session (`left_behind`)."""
        self.rank_pids.update(pids.values())
        self.mark(phases.WORKERS_STARTED)

    def finishing(self) -> bool:
        """Whether a rank has written "finished" (its last step done): a job that ends on its
        own is never stopped for a measured switch (it relaunched a finished job at its last
        checkpoint)."""
        if self.run_dir is None:
            return False
        where = RunDir(self.run_dir)
        return any((r := read_record(str(where.progress(lr)))) is not None
                   and r.phase == FINISHED for lr in range(self.nproc))

    def raised_now(self) -> bool:
        """Whether a rank has just left an error record (`first_raised`): it wrote it before
        any barrier or teardown (and before its exit), acted on now, not when its peers stall.
        Looked for until a stall or a record is seen."""
        if self.stall is not None or self.raised is not None or self.run_dir is None:
            return False
        self.raised = first_raised(self.run_dir, self.nproc)
        if self.raised is None:
            return False
        self.mark(phases.FAULT_SEEN)
        return True

    def stalled(self, pids: Callable[[], Mapping[int, int]],
                ranks: list[tuple[int, int]]) -> bool:
        """Whether the watch sees a stall now (``pids``: each local rank's process, read when
        needed; ``ranks``: ``(local_rank, rank)``); then the evidence is taken before the stop
        (`take_evidence`)."""
        if self.stall is not None:
            return False
        self.stall = self.watch.poll(pids())
        if self.stall is None:
            return False
        self.stall_at = time.time()  # wall time, as the ranks' error records
        self.mark(phases.FAULT_SEEN, self.stall_at)
        self.take_evidence(pids(), ranks)
        return True

    def take_evidence(self, pids: Mapping[int, int], ranks: list[tuple[int, int]]) -> None:
        """A stalled group's evidence before the kill: the ranks' Python stacks and torch's
        flight recorder dumps; a stopped rank (its state is its evidence) is neither asked nor
        waited for. Never raises."""
        with contextlib.suppress(Exception):
            dump_stacks(pids, self.run_dir)
        if self.run_dir is not None:
            try:
                self.flight = dump_flight(self.run_dir, ranks, pids)
            except Exception as exc:  # evidence never stops the stop
                log.warning("flight recorder: not collected: %s", exc)
        self.mark(phases.EVIDENCE_TAKEN)

    def switch_due(self) -> bool:
        """Whether the supervisor stopped the healthy group at a checkpoint for a measured
        switch (never after a fault, nor once a rank is finishing: `finishing`)."""
        if (self.switch is None or self.switched is not None or self.stall is not None
                or self.raised is not None or self.finishing()):
            return False
        self.switched = self.switch()
        return self.switched is not None

    def peer_failed(self) -> bool:
        """Whether another node's workers failed (the peer watch): ours are stopped too."""
        if self.peer is None or self.peer_fault is not None:
            return False
        self.peer_fault = self.peer.poll()
        return self.peer_fault is not None

    def healthy_checks(self, pids: Callable[[], Mapping[int, int]],
                       ranks: list[tuple[int, int]]) -> bool:
        """Whether a healthy group is to be stopped: a stall, a switch, a peer's fault."""
        return self.stalled(pids, ranks) or self.switch_due() or self.peer_failed()


if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.local_elastic_agent import (
        LocalElasticAgent as _ElasticAgent,
    )
else:
    _ElasticAgent = object


def _elastic_api() -> Any:
    """torch's elastic agent API (``RunResult``, ``WorkerState``)."""
    from torch.distributed.elastic.agent.server import api

    return api


class SupervisedHooks(_ElasticAgent):
    """The hooks our agent puts in torch's ``LocalElasticAgent`` (`_agent_class` mixes them in
    first; ``super()`` is torch's agent): its workers' pids and phase marks, the rendezvous
    watched, a warm start's workers, the monitoring loop's own checks (`AttemptMonitor`), a
    stop that kills a stopped worker at once (`prepare_stop`) with the configured grace."""

    #: whether torch's ``_shutdown`` takes a timeout (2.13's; 2.11's takes ``is_restart``)
    takes_timeout = False

    def __init__(self, *args: Any, monitor: AttemptMonitor, warm: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.monitor = monitor
        #: the workers are forked from the fork server (run/warm.py), the entry point a
        #: function whose arguments start with the environment they must have
        self.warm = warm
        self._worker_args: tuple[Any, ...] | None = None

    def _pids(self) -> dict[int, int]:
        """Each local rank's process (none before the workers start)."""
        try:
            return dict(self._pcontext.pids()) if self._pcontext is not None else {}
        except Exception:  # torch's process context between states
            return {}

    def _rendezvous(self, worker_group: Any) -> Any:
        """torch's rendezvous, in a thread of its own while this one watches the store: a node
        cut off from it, or another node of the attempt gone silent, ends the wait within the
        heartbeat window (torch's own wait is its join timeout, minutes), and the agent ends
        as a rendezvous that exited (no worker started)."""
        parent_rendezvous = super()._rendezvous
        try:
            return watched(lambda: parent_rendezvous(worker_group), self.monitor.peer)
        except LeftRendezvous as left:  # the others are gone, or this node is cut off
            self.monitor.peer_fault = left.fault
            self._remaining_restarts = 0
            raise rendezvous_exit(f"the rendezvous was left: {left}") from None

    def _start_workers(self, worker_group: Any) -> Any:
        if self.warm:  # a fresh worker's environment: this process's, now (then the agent's)
            spec = worker_group.spec
            if self._worker_args is None:
                self._worker_args = tuple(spec.args)
            spec.args = (dict(os.environ), *self._worker_args)
        started = super()._start_workers(worker_group)
        self.monitor.started(self._pids())
        return started

    def _monitor_workers(self, worker_group: Any) -> Any:
        result = self._watched(worker_group)
        state = _elastic_api().WorkerState
        if result.state in (state.FAILED, state.UNHEALTHY):
            self.monitor.mark(phases.FAULT_SEEN)
        return result

    def _forked(self) -> list[Any]:
        """A warm start's worker processes (multiprocessing's), or none."""
        pc = getattr(self._pcontext, "_pc", None) if self.warm else None
        return list(getattr(pc, "processes", None) or ())

    def _warm_monitor(self, worker_group: Any) -> Any:
        """torch's look at forked workers, with two differences from started ones smoothed: a
        worker that failed makes torch stop the others at once (SIGTERM, within this call), so
        a stopped peer is killed at once and any other continued first to get it
        (`prepare_stop`, as `_shutdown` does); and once every worker has exited 0 or handed its
        value back, they succeeded (`finished_without_values`)."""
        api = _elastic_api()
        procs = self._forked()
        if any(p.exitcode not in (None, 0) for p in procs):
            prepare_stop({i: p.pid for i, p in enumerate(procs) if p.exitcode is None and p.pid})
        try:
            result = super()._monitor_workers(worker_group)
        except (EOFError, pickle.UnpicklingError):
            # torch's spawn context reads a failed child's traceback from a temporary
            # file, empty on a full TMPDIR: the failure is the workers' exit codes
            return _failed_from_exit_codes(worker_group, procs)
        if result.state != api.WorkerState.HEALTHY or not procs or not finished_without_values(
                [p.exitcode for p in procs],
                set(getattr(self._pcontext, "_return_values", None) or ())):
            return result
        with contextlib.suppress(Exception):  # the workers that returned may exit
            self._pcontext._worker_finished_event.set()  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            if self._pcontext is not None:
                self._pcontext.close()
        return api.RunResult(state=api.WorkerState.SUCCEEDED, return_values={
            w.global_rank: None for w in worker_group.workers})

    def _look(self, worker_group: Any) -> Any:
        """torch's look at the workers (forked ones: `_warm_monitor`)."""
        return (self._warm_monitor(worker_group) if self.warm
                else super()._monitor_workers(worker_group))

    def _stop_group(self) -> Any:
        """An unhealthy group, never restarted (as torch's agent does for a wedged worker)."""
        self._remaining_restarts = 0
        return _elastic_api().RunResult(state=_elastic_api().WorkerState.UNHEALTHY)

    def _watched(self, worker_group: Any) -> Any:
        state = _elastic_api().WorkerState
        result = self._look(worker_group)
        if result.state in (state.HEALTHY, state.FAILED) and self.monitor.raised_now():
            if result.state == state.FAILED:
                return result  # the exits seen with it are part of the story
            # a peer that exited before the record was written (the root cause of its
            # "connection closed") is seen by a second look, after the record
            again = self._look(worker_group)
            return again if again.state == state.FAILED else self._stop_group()
        if result.state == state.HEALTHY and self.monitor.healthy_checks(
                self._pids, [(w.local_rank, w.global_rank) for w in worker_group.workers]):
            return self._stop_group()
        return result

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(Exception):
            prepare_stop(self._pids())
        super()._shutdown(*args, **stop_grace(args, kwargs, self.takes_timeout,
                                              getattr(self, "_shutdown_timeout", 30)))


def _agent_class() -> type[Any]:
    """LocalElasticAgent with `SupervisedHooks` (built on first use: torch is imported then)."""
    if _AGENT:
        return _AGENT[0]
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    _cheap_method_names()

    class SupervisedAgent(SupervisedHooks, LocalElasticAgent):
        # torch 2.13's _shutdown(death_sig, timeout); torch 2.11's (death_sig, is_restart)
        takes_timeout = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters

    _AGENT.append(SupervisedAgent)
    return SupervisedAgent
