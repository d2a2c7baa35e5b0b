"""Who started this process, read from its environment: the one description of the launcher.

Pure: an environment ``Mapping`` in, a `Launcher` value out (`launcher_from`); no process, no
``os``. ``machine/scontrol.detect_launcher`` adds the one effect, SLURM's own expansion of a
node list (``scontrol show hostnames``), and hands its first host in.

The launchers, by precedence:

- **the user's own variables, or torchrun's** (``RANK`` or ``WORLD_SIZE`` set; torchrun also
  sets ``TORCHELASTIC_RUN_ID``): they win over everything, so ``srun torchrun ...`` is torchrun's
  job (torchrun's workers carry SLURM's variables too, and SLURM's ``SLURM_PROCID`` there is the
  node's task, not the worker's rank).
- **SLURM's srun** (an srun task: ``SLURM_STEP_ID`` and ``SLURM_PROCID`` set, no ``RANK``):
  the rank is ``SLURM_PROCID``, the job's processes ``SLURM_STEP_NUM_TASKS`` (else
  ``SLURM_NTASKS``), the local rank ``SLURM_LOCALID``, the node ``SLURM_NODEID``, the processes
  on this node that node's count in ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: SLURM's
  run-length form), the rendezvous host the first host of ``SLURM_STEP_NODELIST`` (else
  ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``), on the port `slurm_port` derives from the job id.
  These are handed to the framework as torchrun's variables (`Launcher.derived`), never over one
  the user set (``MASTER_ADDR=... srun ...`` keeps the user's address).
- **an sbatch batch script** (``SLURM_JOB_ID`` set, no ``SLURM_STEP_ID``): one process, even
  where ``SLURM_NTASKS`` says 2 (the batch script runs once; its tasks are srun's to start).
- **plain python**: one process.

Lightning reads the same variables (``lightning/fabric/plugins/environments/slurm.py``,
``SLURMEnvironment``), and derives its port from the job id the same way (15000 plus the last
four digits of ``SLURM_JOB_ID``); it tells an srun task apart by the job name, where the batch
script is told apart here by the missing ``SLURM_STEP_ID`` (measured on slurm-wlm 22.05: a
batch script has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` but no step id).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

LauncherKind = Literal["python", "torchrun", "environment", "slurm", "slurm-batch"]
LAUNCHER_KINDS: tuple[LauncherKind, ...] = ("python", "torchrun", "environment", "slurm",
                                             "slurm-batch")

#: The rendezvous port of an srun job: SLURM_PORT_BASE + job id % SLURM_PORT_SPAN (15000-24999),
#: Lightning's arithmetic; below Linux's default ephemeral range (32768-60999), so a port the
#: kernel hands out to a client socket does not take it.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 10000

#: The variables a launcher hands the framework (torchrun's names).
DERIVED_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")

#: At most this many hosts from one node list (a typo such as node[1-99999999] stays bounded).
MAX_HOSTS = 1_000_000


class HostlistError(ValueError):
    """A node list (or tasks-per-node list) that SLURM's syntax does not allow."""


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested brackets in {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"']' without '[' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"'[' without ']' in {text!r}")
    parts.append(text[start:])
    return parts


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _range_values(inside: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in inside.split(","):
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise HostlistError(f"{item!r} is not a number or a range in {whole!r}")
        low, high = m.group(1), m.group(2)
        width = len(low)  # node[01-10]: the lower bound's digits set the padding
        top = int(high) if high is not None else int(low)
        if top < int(low):
            raise HostlistError(f"range {item!r} runs backwards in {whole!r}")
        if top - int(low) >= MAX_HOSTS:
            raise HostlistError(f"range {item!r} names more than {MAX_HOSTS} hosts")
        out += [str(n).zfill(width) for n in range(int(low), top + 1)]
    return out


def expand_hostlist(text: str) -> tuple[str, ...]:
    """SLURM's node list expanded as ``scontrol show hostnames`` does: ``node[01-03,07],gpu5``
    is node01, node02, node03, node07, gpu5; padding follows the lower bound's digits; several
    bracket groups in one name multiply (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2)."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        part = part.strip()
        if not part:
            continue
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            if piece.startswith("["):
                values = _range_values(piece[1:-1], text)
                if len(names) * len(values) > MAX_HOSTS:
                    raise HostlistError(f"{text!r} names more than {MAX_HOSTS} hosts")
                names = [n + v for n in names for v in values]
            else:
                names = [n + piece for n in names]
        hosts += names
        if len(hosts) > MAX_HOSTS:
            raise HostlistError(f"{text!r} names more than {MAX_HOSTS} hosts")
    return tuple(hosts)


def expand_tasks_per_node(text: str) -> tuple[int, ...]:
    """SLURM's tasks per node (``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``):
    ``2(x3),1`` is 2, 2, 2, 1."""
    out: list[int] = []
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise HostlistError(f"{item!r} is not a task count in {text!r}")
        repeat = int(m.group(2) or 1)
        if len(out) + repeat > MAX_HOSTS:
            raise HostlistError(f"{text!r} names more than {MAX_HOSTS} nodes")
        out += [int(m.group(1))] * repeat
    return tuple(out)


def slurm_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id``: the same on every task of the job, with no
    word between them (`SLURM_PORT_BASE` + ``job_id % SLURM_PORT_SPAN``)."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


@dataclass(frozen=True)
class Launcher:
    """Who started this process and where it sits in the job. ``derived``: the variables the
    framework needs that the launcher did not set under torchrun's names (SLURM's ranks and
    rendezvous), less any the user set; ``sources``: for each derived variable, what it came
    from (``"SLURM_PROCID"``, ``"first host of SLURM_STEP_NODELIST"``, ...)."""

    kind: LauncherKind = "python"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None
    node_rank: int = 0
    nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None
    derived: Mapping[str, str] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    #: what could not be read, in words (the derived value then falls back: a note, not an error)
    notes: tuple[str, ...] = ()

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with the derived variables added where it has none of them (the user's win)."""
        return {**{k: v for k, v in self.derived.items() if k not in env}, **env}


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    return int(text) if text.isdigit() else None


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def _first_list(env: Mapping[str, str], names: tuple[str, ...],
                parse: Callable[[str], tuple[Any, ...]],
                notes: list[str]) -> tuple[str, tuple[Any, ...]] | None:
    """The first of ``names`` set in ``env`` and its value parsed (a malformed one noted in
    ``notes``, parsed as empty); None where none is set. Pure."""
    listed = _first(env, *names)
    if listed is None:
        return None
    try:
        return listed[0], parse(listed[1])
    except HostlistError as exc:
        notes.append(f"{listed[0]}: {exc}")
        return listed[0], ()


def launcher_from(env: Mapping[str, str],
                  expand: Callable[[str], tuple[str, ...]] | None = None) -> Launcher:
    """The launcher of a process whose environment is ``env``. ``expand``: a node list's hosts
    (default `expand_hostlist`; ``machine/scontrol`` passes SLURM's own ``scontrol``)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        kind: LauncherKind = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "environment"
        port = _int(env, "MASTER_PORT")
        return Launcher(kind, rank=_int(env, "RANK") or 0, local_rank=_int(env, "LOCAL_RANK") or 0,
                        world_size=_int(env, "WORLD_SIZE") or 1,
                        local_world_size=_int(env, "LOCAL_WORLD_SIZE"),
                        node_rank=_int(env, "GROUP_RANK") or 0,
                        master_addr=env.get("MASTER_ADDR") or None, master_port=port,
                        job_id=env.get("SLURM_JOB_ID") or None)
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return _slurm(env, expand or expand_hostlist)
    if env.get("SLURM_JOB_ID", "").strip():
        return Launcher("slurm-batch", job_id=env["SLURM_JOB_ID"].strip())
    return Launcher()


def _slurm(env: Mapping[str, str], expand: Callable[[str], tuple[str, ...]]) -> Launcher:
    notes: list[str] = []
    sources: dict[str, str] = {}
    rank = _int(env, "SLURM_PROCID")
    world_name = "SLURM_STEP_NUM_TASKS" if _int(env, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    world = _int(env, world_name) or 1
    local_rank = _int(env, "SLURM_LOCALID") or 0
    node_rank = _int(env, "SLURM_NODEID") or 0
    if rank is None or not 0 <= rank < world:
        notes.append(f"SLURM_PROCID={env.get('SLURM_PROCID')!r} is not a rank of {world} tasks")
        rank = 0
    per_node: tuple[int, ...] = ()
    tasks = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tasks is not None:
        try:
            per_node = expand_tasks_per_node(tasks[1])
        except HostlistError as exc:
            notes.append(f"{tasks[0]}: {exc}")
    nodes = len(per_node) if per_node else (_int(env, "SLURM_STEP_NUM_NODES")
                                            or _int(env, "SLURM_NNODES") or 1)
    local_world: int | None = None
    if per_node and node_rank < len(per_node):
        local_world = per_node[node_rank]
        sources["LOCAL_WORLD_SIZE"] = f"{tasks[0] if tasks else ''}[SLURM_NODEID]"
    elif nodes == 1:
        local_world = world
        sources["LOCAL_WORLD_SIZE"] = world_name
    master_addr: str | None = None
    listed = _first_list(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
                         expand, notes)
    if listed is not None and listed[1]:
        master_addr = listed[1][0]
        sources["MASTER_ADDR"] = f"first host of {listed[0]}"
    job = _int(env, "SLURM_JOB_ID") or _int(env, "SLURM_JOBID")
    master_port = None if job is None else slurm_port(job)
    derived: dict[str, str] = {"RANK": str(rank), "WORLD_SIZE": str(world),
                               "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(node_rank)}
    sources.update(RANK="SLURM_PROCID", WORLD_SIZE=world_name, LOCAL_RANK="SLURM_LOCALID",
                   GROUP_RANK="SLURM_NODEID")
    if local_world is not None:
        derived["LOCAL_WORLD_SIZE"] = str(local_world)
    if master_addr is not None:
        derived["MASTER_ADDR"] = master_addr
    if master_port is not None:
        derived["MASTER_PORT"] = str(master_port)
        sources["MASTER_PORT"] = (f"{SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}")
    kept = {k: v for k, v in derived.items() if k not in env}
    addr = env.get("MASTER_ADDR") or master_addr
    port_text = env.get("MASTER_PORT")
    port = int(port_text) if port_text and port_text.isdigit() else master_port
    return Launcher(
        "slurm", rank=rank, local_rank=local_rank, world_size=world,
        local_world_size=local_world, node_rank=node_rank, nodes=nodes,
        master_addr=addr, master_port=port, job_id=str(job) if job is not None else None,
        derived=kept, sources={k: v for k, v in sources.items() if k in kept},
        notes=tuple(notes))


#: ``resilient-strategy run``'s node options that SLURM may fill (torchrun's spelling).
RUN_NODE_OPTIONS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--master-addr",
                    "--master-port", "--nproc-per-node")


@dataclass(frozen=True)
class RunLaunch:
    """Who started ``resilient-strategy run`` and the node options read from it where the user
    gave none (`run_launch`): ``launcher`` (``slurm``: an srun task; else the kind, nothing
    read), the values taken (None: the command line's), what each came from (``sources``: option
    -> variable), and the srun tasks on this node (``tasks_per_node``: more than one is refused,
    run starts the node's processes itself)."""

    launcher: LauncherKind = "python"
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: int | None = None
    tasks_per_node: int = 1
    tasks_source: str = ""
    job_id: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        """srun started more than one ``run`` on this node."""
        return self.launcher == "slurm" and self.tasks_per_node > 1

    def words(self) -> str:
        """The launch in one line (empty when run was not started by srun)."""
        if self.launcher != "slurm":
            return ""
        job = f" job {self.job_id}" if self.job_id else ""
        taken = [f"{opt} {value} from {self.sources[opt]}" for opt, value in (
            ("--nnodes", self.nnodes), ("--node-rank", self.node_rank),
            ("--master-addr", self.master_addr), ("--master-port", self.master_port),
            ("--nproc-per-node", self.nproc)) if value is not None and opt in self.sources]
        return (f"launched by srun (SLURM{job}, one task per node): "
                + ("; ".join(taken) if taken else "every node option from the command line"))


def _gpu_count(text: str) -> int | None:
    """A GPU count as SLURM writes it: ``2``, or ``a100:2`` (a type, then the count)."""
    tail = text.strip().rpartition(":")[2]
    return int(tail) if tail.isdigit() and int(tail) > 0 else None


def run_launch(launcher: Launcher, env: Mapping[str, str],
               given: frozenset[str] = frozenset()) -> RunLaunch:
    """``resilient-strategy run``'s node options from SLURM, for an srun task (``launcher``
    of kind ``slurm``: no torchrun or user ``RANK``), each only where the user gave none
    (``given``: the `RUN_NODE_OPTIONS` on the command line): ``--nnodes`` from the step's nodes
    (``SLURM_STEP_NUM_NODES``, ``SLURM_NNODES``), ``--node-rank`` from ``SLURM_NODEID``, and,
    across nodes, the rendezvous at the first host of the node list on the job's port (as for
    ``srun python``; neither where the user gave ``--rdzv-endpoint`` or ``--master-addr``; a
    ``MASTER_ADDR`` / ``MASTER_PORT`` of the user's environment wins as it does there);
    ``--nproc-per-node`` from ``SLURM_GPUS_ON_NODE``, else ``SLURM_GPUS_PER_TASK`` (one task per
    node: its GPUs are the node's). The tasks srun started on this node: this node's count in
    ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``. Pure."""
    if launcher.kind != "slurm":
        return RunLaunch(launcher.kind)
    sources: dict[str, str] = {}
    notes: list[str] = list(launcher.notes)
    tasks, tasks_source = 1, ""
    listed = _first_list(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"),
                         expand_tasks_per_node, notes)
    if listed is not None:
        counts = listed[1]
        if counts:
            here = launcher.node_rank if launcher.node_rank < len(counts) else 0
            tasks = counts[here] if listed[0] == "SLURM_STEP_TASKS_PER_NODE" else counts[0]
            tasks_source = listed[0]
    nnodes = node_rank = port = nproc = None
    addr: str | None = None
    if "--nnodes" not in given:
        nnodes = launcher.nodes
        sources["--nnodes"] = ("SLURM_STEP_TASKS_PER_NODE"
                               if env.get("SLURM_STEP_TASKS_PER_NODE") else
                               "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES")
                               else "SLURM_NNODES")
    if "--node-rank" not in given:
        node_rank = launcher.node_rank
        sources["--node-rank"] = "SLURM_NODEID"
    across = (nnodes if nnodes is not None else 1) > 1 or "--nnodes" in given
    if across and not given & {"--rdzv-endpoint", "--master-addr"}:
        addr = launcher.master_addr
        if addr is not None:
            sources["--master-addr"] = ("MASTER_ADDR" if env.get("MASTER_ADDR") else
                                        launcher.sources.get("MASTER_ADDR", "SLURM"))
        if "--master-port" not in given and launcher.master_port is not None:
            port = launcher.master_port
            sources["--master-port"] = ("MASTER_PORT" if env.get("MASTER_PORT") else
                                        launcher.sources.get("MASTER_PORT", "SLURM_JOB_ID"))
    if "--nproc-per-node" not in given:
        gpus = _first(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK")
        if gpus is not None:
            nproc = _gpu_count(gpus[1])
            if nproc is None:
                notes.append(f"{gpus[0]}={gpus[1]!r} is not a GPU count")
            else:
                sources["--nproc-per-node"] = gpus[0]
    return RunLaunch("slurm", nnodes, node_rank, addr, port, nproc, tasks, tasks_source,
                     launcher.job_id, sources, tuple(notes))
