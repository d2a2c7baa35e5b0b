"""python -m resilient_strategy doctor | plan | probe | run (also the resilient-strategy script).

Longer than ~450 lines on purpose: one module for the command line (each subcommand's parser,
its text and JSON output, its exit codes); the work itself lives in the rooms below.

doctor  what this machine has (GPUs, links, versions, host), the rules that fired and the plan
        with its reasons; runs usefully without a GPU. Never probes.
plan    only the plan (for the framework given, or each one installed).
probe   prove the candidates for real (probe="force" with --force) and print the decision.
cache   what the decision cache holds per machine fingerprint (``cache show [--json]``), and
        removing it (``cache clear`` this machine's, ``--fingerprint F`` or ``--all``).
run     run a training script under the supervisor (torchrun's options; ``run --help``): decide
        once, launch the workers the decision needs, relaunch on the next candidate when a
        collective fails or stalls mid-run (see `resilient_strategy.run.supervisor`).

--simulate FILE plans for a described machine instead (what-if before renting one): a JSON
object with "machine" (keyword arguments of resilient_strategy.testing.simulation.machine, "links" written as
{"0-1": 4}) or "facts" (the Facts.to_dict() form), and optionally "probes" (simulated outcomes, see
simulation.SimulatedProber), "framework", "global_batch_size", "gradient_bytes" and "sample_seconds". The
simulated machine's environment is the file's; only RESILIENT_STRATEGY_RULES and
RESILIENT_STRATEGY_DISABLE_RULES come from yours (the rules are yours, not the machine's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .core.call.fields import CALL
from .core.values.facts import FABRIC_MIN_GPUS, Facts
from .core.values.human import human_duration
from .errors import ResilientStrategyError
from .machine import env as machine_env
from .testing.simulation import SimulatedProber, load_simulation
from .vocab import FRAMEWORKS

_FRAMEWORKS = FRAMEWORKS
#: Exit statuses of doctor / plan / probe (``run`` adds its own: see run.supervisor.supervise).
EXIT_OK = 0
#: a bad argument or option value (argparse exits 2 too), an unreadable --simulate or rules file,
#: an unknown --disable-rule, or ``probe`` with no framework installed to probe
EXIT_USAGE = 2
#: ``cache clear --fingerprint F``: nothing is cached for F (a typo, or cleared already)
EXIT_NOTHING_CACHED = 1
#: Variables of the user's own environment that a simulation honours (they configure this
#: library, they do not describe the simulated machine).
_SIMULATION_PASSTHROUGH = (CALL["rules"].env, CALL["disable_rules"].env)
_LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_LAUNCH_HINT = {"torch": "; --nproc-per-node N plans another launch", "tensorflow": ""}


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        return value

    return parse


_positive_int = _int_at_least(1)


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors in one line (its default prints the usage first), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="resilient-strategy", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    for name, text in (("doctor", "show what is here and the plan"), ("plan", "the plan only"),
                       ("probe", "prove the candidates with live probes")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--framework", choices=_FRAMEWORKS)
        s.add_argument("--global-batch-size", type=_positive_int)
        s.add_argument("--gradient-bytes", type=_positive_int,
                       help="model gradient size, for speed ranking")
        s.add_argument("--json", action="store_true", help="machine-readable output")
        s.add_argument("--simulate", type=Path, metavar="FILE", help="plan for a described machine")
        s.add_argument("--timeout", type=float, help="seconds per probe (default 30)")
        s.add_argument("--force", action="store_true", help="probe: ignore cached results")
        s.add_argument("--logical-cpus", type=_int_at_least(0), default=0,
                       help="TensorFlow probes on N logical CPU devices (testing without GPUs); "
                            "other frameworks plan as usual")
        s.add_argument("--rules", action="append", default=[], type=Path, metavar="FILE",
                       help="an extra known-issue rules file (TOML); repeatable")
        s.add_argument("--disable-rule", action="append", default=[], metavar="ID",
                       help="switch off a known-issue rule by id; repeatable")
        s.add_argument("--nproc-per-node", type=_positive_int, metavar="N",
                       help="plan torch as rank 0 of `torchrun --nproc_per_node N` (default: one "
                            "process per visible GPU when there are 2 or more, else plain python)")
    c = sub.add_parser("cache", help="show or clear the cached probe results")
    csub = c.add_subparsers(dest="cache_command", required=True)
    show = csub.add_parser("show", help="list what is cached, per machine fingerprint")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    clear = csub.add_parser("clear", help="remove cached results (default: this machine's)")
    which = clear.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every fingerprint's")
    which.add_argument("--fingerprint", metavar="F", help="this fingerprint's (see cache show)")
    # listed for --help only: main() hands `run ...` to the supervisor's own parser (torchrun's)
    sub.add_parser("run", add_help=False, help="run a training script under the supervisor: "
                   "decide once, retry or step down when a collective fails mid-run "
                   "(`run --help`)")
    return p


def _cache_command(args: argparse.Namespace, real_env: Mapping[str, str]) -> int:
    """``cache show`` / ``cache clear``: EXIT_OK done; EXIT_NOTHING_CACHED ``--fingerprint``
    names nothing cached; EXIT_USAGE the directory is not safely this user's, or the fingerprint
    is not one."""
    from .core.call.options import DEFAULT_TTL_S, default_dir
    from .deciding.cache import DecisionCache
    from .machine.files import check_private_dir, safe_name

    cache = DecisionCache(default_dir(real_env), DEFAULT_TTL_S)
    try:
        check_private_dir(cache.directory)
    except FileNotFoundError:
        pass  # nothing cached yet
    except (ResilientStrategyError, OSError) as exc:
        print(f"resilient_strategy: cache directory {cache.directory}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.cache_command == "clear" and args.fingerprint is not None:
        if not safe_name(args.fingerprint):
            print(f"resilient_strategy: --fingerprint {args.fingerprint!r} is not a fingerprint "
                  "(see `cache show`)", file=sys.stderr)
            return EXIT_USAGE
        if not cache.clear(args.fingerprint):
            print(f"resilient_strategy: nothing is cached for fingerprint {args.fingerprint} in "
                  f"{cache.directory} (see `cache show`)", file=sys.stderr)
            return EXIT_NOTHING_CACHED
        print(f"Removed the cache of fingerprint {args.fingerprint}.")
        return EXIT_OK
    from .machine.inspect import detect_facts

    here = detect_facts(real_env).fingerprint()
    if args.cache_command == "clear":
        gone = cache.clear_all() if args.all else [here] if cache.clear(here) else []
        print(f"Removed the cache of {len(gone)} fingerprint{'s' if len(gone) != 1 else ''}"
              + (f" ({', '.join(gone)})" if gone else "") + f" in {cache.directory}.")
        return EXIT_OK
    report = cache.report(here)
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"Decision cache {cache.directory} (entries expire after "
          f"{cache.ttl_s / 86400:g} days); this machine's fingerprint is {here}.")
    if not report["fingerprints"]:
        print("Nothing is cached.")
    for fp, data in report["fingerprints"].items():
        print("", *_cache_lines(fp, data), sep="\n")
    return EXIT_OK


def _machine_cache(real_env: Mapping[str, str], fingerprint: str) -> dict[str, Any]:
    """This machine's cache entries for ``doctor`` (``cache show``'s data for one fingerprint)."""
    from .core.call.options import DEFAULT_TTL_S, default_dir
    from .deciding.cache import DecisionCache

    cache = DecisionCache(default_dir(real_env), DEFAULT_TTL_S)
    empty = {"this_machine": True, "path": str(cache.path(fingerprint)), "entries": []}
    data: dict[str, Any] = cache.report(fingerprint)["fingerprints"].get(fingerprint, empty)
    return data


def _cache_lines(fp: str, data: Mapping[str, Any]) -> list[str]:
    out = [f"{fp}{' (this machine)' if data['this_machine'] else ''}: {data['path']}"]
    for e in data["entries"]:
        why = f" {e['cause']}" if e["cause"] else ""
        notes = [n for n in ("expired" if e["expired"] else "",
                             f"ignored: {e['ignored']}" if e["ignored"] else "") if n]
        out.append(f"  {e['candidate']}: {e['status']}{why}, seen {e['seen']}x"
                   + (f" ({'; '.join(notes)})" if notes else ""))
    return out


def _version() -> str:
    from . import __version__

    return __version__


def _check_disabled_rules(args: argparse.Namespace, real_env: Mapping[str, str]) -> None:
    """--disable-rule with an id that no rule has is an error listing the known ids: a typo would
    otherwise leave the rule on without a word."""
    if not args.disable_rule:
        return
    from .core.knowledge.rules import load_rules

    extra: list[str | Path] = [x for x in real_env.get(CALL["rules"].env, "").split(
        os.pathsep) if x.strip()]
    known = {r.id for r in load_rules([*extra, *args.rules])}
    unknown = sorted(set(args.disable_rule) - known)
    if unknown:
        raise ResilientStrategyError(
            f"--disable-rule {', '.join(unknown)}: no such rule. Known rule ids: "
            + ", ".join(sorted(known)))


def _frameworks(facts: Facts, asked: str | None) -> list[str]:
    if asked:
        return [asked]
    return [f for f in _FRAMEWORKS if facts.framework(f).installed]


def _facts_text(facts: Facts) -> list[str]:
    out = ["GPUs the job can see:"]
    if not facts.gpus:
        out.append(f"  none ({facts.nvml_error or 'NVML reported no GPU'})")
    for g in facts.gpus:
        mig = ", MIG" if g.mig_enabled else ""
        out.append(f"  [{g.index}] {g.name}  cc {g.cc}  {g.memory_bytes / 2**30:.0f} GiB  "
                   f"pci {g.pci_bus_id or '?'}  nvml #{g.physical_index}{mig}")
    vis = facts.visibility
    out.append(f"  CUDA_VISIBLE_DEVICES={vis.raw!r} -> NVML {list(vis.physical)}"
               if vis.raw is not None else "  CUDA_VISIBLE_DEVICES unset: every GPU")
    out += [f"  note: {n}" for n in vis.notes]
    out += [f"  NVML could not read: {n}" for n in facts.nvml_notes]
    if facts.links or facts.fabric:
        out.append("Links:")
        listed = [(f"{ln.a}-{ln.b}", ln) for ln in facts.links]
        if facts.fabric is not None:
            listed.append(("every other pair" if facts.links else "every pair", facts.fabric))
        for name, ln in listed:
            nv = f"NVLink x{ln.nvlinks}" if ln.nvlinks else "no NVLink"
            out.append(f"  {name}: {nv}, PCIe path {ln.topology}, P2P read {ln.p2p_read}")
    if 2 <= len(facts.gpus) <= FABRIC_MIN_GPUS:  # past that, the fabric line above says it
        out.append("GPU link matrix (as `nvidia-smi topo -m`):")
        out += ["  " + "  ".join(f"{cell:<5}" for cell in row).rstrip()
                for row in link_matrix(facts)]
        out.append("  " + _MATRIX_LEGEND)
    if facts.driver_version:
        out.append(f"Driver {facts.driver_version} (CUDA {facts.cuda_driver_version})")
    h = facts.host
    shm = "unknown" if h.shm_bytes is None else f"{h.shm_bytes / 2**20:.0f} MiB"
    flags = [x for x, on in (("WSL2", h.wsl2), ("SageMaker", h.sagemaker), ("AWS", h.aws),
                             ("EFA", h.efa), ("InfiniBand", h.infiniband)) if on]
    out.append(f"Host: /dev/shm {shm}, container {h.container or 'none'}, IOMMU {h.iommu}, "
               f"{h.cpu_count} CPUs" + (f", {', '.join(flags)}" if flags else ""))
    out.append(_platform_line(facts))
    out.append(_layout_line(facts))
    out.append("Frameworks:")
    for f in facts.frameworks:
        if not f.installed:
            continue
        bits = [f"{f.name} {f.version}"]
        if f.distribution and f.distribution != f.name:
            bits.append(f"({f.distribution})")
        bits.append(f"CUDA {f.cuda}" if f.cuda else f"ROCm build (HIP {f.hip or '?'})"
                    if f.build == "rocm" else "CPU-only build" if f.name != "keras" else "")
        if f.nccl:
            bits.append(f"NCCL {f.nccl}")
        if f.archs:
            bits.append("archs " + ",".join(f.archs))
        if f.imported:
            bits.append("IMPORTED" + (", GPUs INITIALIZED" if f.gpu_initialized else ""))
        out.append("  " + " ".join(b for b in bits if b))
    if not any(f.installed for f in facts.frameworks):
        out.append("  neither torch nor tensorflow is installed")
    return out


def _layout_line(facts: Facts) -> str:
    """The host's layout and builds around the GPUs: NUMA, the CPU, AMD GPUs, the CUDA
    forward-compatibility driver, the ephemeral ports ("unknown" where unread)."""
    h = facts.host
    numa = "unknown" if h.numa_nodes is None else f"{h.numa_nodes} node(s) with memory" + (
        f" ({h.numa_memory_only} without a CPU)" if h.numa_memory_only else "")
    gpu_nodes = [g.numa_node for g in facts.gpus]
    if gpu_nodes and any(n is not None for n in gpu_nodes):
        numa += ", GPUs on " + ",".join("?" if n is None else str(n) for n in gpu_nodes)
    bits = [f"NUMA {numa}", f"CPU {h.machine or 'unknown'}"]
    if h.platform == "darwin" and h.machine in ("arm64", "aarch64"):
        bits.append("Apple silicon: one MPS device, no collective backend for it")
    if h.amd_gpus is not None:
        bits.append(f"{h.amd_gpus} AMD GPU(s) (ROCm driver)")
    if h.cuda_compat:
        bits.append(f"CUDA forward-compatibility driver {h.cuda_compat} in the image")
    bits.append(f"ephemeral ports {h.port_range or 'unknown'}")
    return "Layout: " + ", ".join(bits)


#: NVML's PCIe path levels in ``nvidia-smi topo -m``'s words.
_TOPO_WORDS = {"internal": "PIX", "single": "PIX", "multiple": "PXB", "hostbridge": "PHB",
               "node": "NODE", "system": "SYS"}
_MATRIX_LEGEND = ("X = self, NV# = # NVLinks, PIX/PXB = one/several PCIe bridges, PHB = PCIe "
                  "host bridge, NODE = within a NUMA node, SYS = across sockets, ? = unknown")


def link_matrix(facts: Facts) -> tuple[tuple[str, ...], ...]:
    """The GPU link matrix the way ``nvidia-smi topo -m`` prints it, as rows of cells (the first
    row and column are the GPU names): ``X`` on the diagonal, ``NV<n>`` for n NVLinks, else the
    PCIe path (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``; ``?`` when unknown). Pure."""
    names = [f"GPU{g.index}" for g in facts.gpus]
    rows: list[tuple[str, ...]] = [("", *names)]
    for g in facts.gpus:
        cells = [f"GPU{g.index}"]
        for h in facts.gpus:
            ln = facts.link(g.index, h.index)
            if g.index == h.index:
                cells.append("X")
            elif ln is None:
                cells.append("?")
            elif ln.nvlinks:
                cells.append(f"NV{ln.nvlinks}")
            else:
                cells.append(_TOPO_WORDS.get(ln.topology, "?"))
        rows.append(tuple(cells))
    return tuple(rows)


def _selection_text(sel: Any, show_probes: bool) -> list[str]:
    out = [sel.explain(verbose=True)]  # doctor, plan, probe: the whole reasoning
    if sel.plan.ranked:
        out.append("Candidates, in the order they are tried (* = chosen):")
        # a model of unknown size: the estimates are of an assumed one, so no seconds are said
        sized = all(getattr(e, "known_size", True) for e in sel.plan.events
                    if getattr(e, "kind", "") == "ranking")
        for i, r in enumerate(sel.plan.ranked, 1):
            c = r.candidate
            mark = "*" if c.key == sel.candidate.key else " "
            first = f"; tried first by rule {c.origin}" if c.first else ""
            cost = (f"~{human_duration(r.estimate.step_seconds)} per global batch" if sized
                    else "no time estimated (the model's size is unknown)")
            out.append(f" {mark}{i}. {c.label}: {_batch_words(c)}; {cost}{first}")
    if sel.plan.ruled_out:
        out.append("Ruled out:")
        for r in sel.plan.ruled_out:  # a rule's words are in the trace above: name it only
            why = f"rule {r.rule} (above)" if r.rule and r.rule != "probe" else r.reason
            out.append(f"  - {r.candidate.label}: {why}")
    if show_probes and sel.results:
        out.append("Probes:")
        out.append(f"  {'candidate':<58} {'status':<8} {'secs':>6} {'GB/s':>8}  cause")
        for key, res in sel.results.items():
            bw = f"{res.bus_bandwidth_gbps:.2f}" if res.bus_bandwidth_gbps else "-"
            out.append(f"  {key:<58} {res.status:<8} {res.elapsed_s:>6.1f} {bw:>8}  {res.cause}")
    return out


def _batch_words(c: Any) -> str:
    """A candidate's batch split in words (replicas, batch per replica, accumulation)."""
    replicas = f"{c.num_replicas} replica{'s' if c.num_replicas != 1 else ''}"
    per = (f" x {c.per_replica_batch_size} samples" if c.per_replica_batch_size
           else " (your per-device batch)")
    steps = f"{c.accumulation_steps} accumulation step{'s' if c.accumulation_steps != 1 else ''}"
    return f"{replicas}{per}, {steps}"


def _decide(args: argparse.Namespace, facts: Facts, sim: Mapping[str, Any] | None,
            framework: str, real_env: Mapping[str, str],
            probers: list[SimulatedProber] | None = None) -> Any:
    from dataclasses import replace

    from .core.call.arguments import Arguments
    from .deciding.executor import Engine

    arguments = Arguments.from_cli(args, framework, sim)
    env = _launch_env(facts, framework, sim, real_env, args.nproc_per_node)
    if sim is not None:
        import tempfile

        probes = sim.get("probes")
        broken = {int(k): str(v) for k, v in dict(sim.get("broken_gpus") or {}).items()}
        prober = SimulatedProber(dict(probes or {}), broken_gpus=broken)
        if probers is not None:
            probers.append(prober)
        arguments = replace(arguments, cache=replace(arguments.cache, cache=False),
                            probing=replace(arguments.probing, dry_run=not probes))
        # the described launch's agreement between local ranks goes to a private directory of
        # its own, removed after: a simulation writes nothing a squatter could stop or read
        with tempfile.TemporaryDirectory(prefix="rs-simulate-") as private:
            env["XDG_RUNTIME_DIR"] = private  # the described machine's, never the user's
            return Engine(prober).select(arguments, env=env, facts=facts)
    if args.command == "probe":  # a launch planned here has no other ranks to share it with
        arguments = replace(arguments, probing=replace(
            arguments.probing, probe="force" if args.force else "auto"))
        return Engine(alone=args.nproc_per_node is not None
                      or "WORLD_SIZE" not in real_env).select(arguments, env=env)
    arguments = replace(arguments, probing=replace(arguments.probing, dry_run=True))
    return Engine().select(arguments, env=env, facts=facts)


def _launch_env(facts: Facts, framework: str, sim: Mapping[str, Any] | None,
                real_env: Mapping[str, str], nproc: int | None = None) -> dict[str, str]:
    """The environment to plan in: the user's, or for a simulation the described machine's plus
    the user's rule settings. PyTorch on 2+ GPUs outside a launcher is planned as rank 0 of
    `torchrun --nproc_per_node N` would plan it: that is how it uses every GPU."""
    from .core.values.launcher import launcher_from

    if sim is None:
        env = dict(real_env)
    else:
        env = dict(facts.env_map)
        for name in _SIMULATION_PASSTHROUGH:
            if name in real_env and name not in env:
                env[name] = real_env[name]
    if launcher_from(env).kind == "slurm":  # an srun task: its ranks are SLURM's, as it runs
        return env
    if framework == "torch" and nproc is not None:  # the launch asked for beats a described one
        for name in _LAUNCH_VARS:
            env.pop(name, None)
    if framework == "torch" and "WORLD_SIZE" not in env:
        n = nproc if nproc is not None else len(facts.gpus) if as_torchrun(facts, framework, env) \
            else 1
        if n > 1:
            env.update(WORLD_SIZE=str(n), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(n))
    return env


def launch_words(sel: Any) -> str:
    """Which launch a plan assumed, in words."""
    launch = sel.launch
    if sel.framework != "torch" and sel.multi_worker:
        return (f"as worker {sel.tf_worker_rank} of the {sel.tf_workers} workers in TF_CONFIG "
                "(one process per worker, as MultiWorkerMirroredStrategy runs)")
    if sel.framework != "torch":
        return "as one process (plain python), as TensorFlow's MirroredStrategy runs"
    seen = [e for e in sel.plan.events if e.kind == "launcher_seen"]
    if launch.world_size > 1 and seen and seen[0].launcher == "slurm":
        return (f"as rank {launch.rank} of the {launch.world_size} tasks of SLURM job "
                f"{seen[0].job_id} (srun)")
    if launch.world_size > 1:
        return (f"as rank {launch.rank} of `torchrun --nproc_per_node {launch.world_size}` "
                f"({launch.world_size} processes)")
    return "as plain python (one process)"


def _binding_view(facts: Facts, selections: Any) -> dict[str, Any] | None:
    """doctor: the launcher the decision saw and the GPUs this process was bound to: what it
    sees by UUID, and the one it would train on (``per_task``: it sees fewer GPUs than there
    are processes on its node, so its own; otherwise the local rank's, if every local rank sees
    the same). The other local ranks' GPUs are compared when the job decides (`GpusBound`)."""
    from .core.values.binding import usable

    for sel in selections:
        seen = [e for e in sel.plan.events if e.kind == "launcher_seen"]
        if seen:
            launch = sel.launch
            break
    else:
        return None
    uuids = usable([g.uuid or f"ordinal-{g.index}" for g in facts.gpus])
    local = launch.local_world_size or launch.world_size
    per_task = local > 1 and 0 < len(uuids) < local
    ordinal = 0 if per_task or local == 1 else launch.local_rank
    return {"launcher": seen[0].to_dict(), "sees": list(uuids), "per_task": per_task,
            "ordinal": ordinal if ordinal < len(uuids) else None,
            "trains_on": uuids[ordinal] if ordinal < len(uuids) else None}


def _launcher_lines(view: Mapping[str, Any] | None) -> list[str]:
    if view is None:
        return []
    out = [str(view["launcher"]["text"])]
    if view["sees"]:
        how = ("its own (fewer than the processes on this node)" if view["per_task"]
               else "the same as every local rank's, if they all see these")
        out.append(f"Binding: this process sees {', '.join(view['sees'])}; it trains on "
                   f"{view['trains_on'] or 'none'} (CUDA ordinal {view['ordinal']}): {how}")
    return out


def as_torchrun(facts: Facts, framework: str, env: Mapping[str, str]) -> bool:
    return framework == "torch" and len(facts.gpus) >= 2 and "WORLD_SIZE" not in env


def _platform_line(facts: Facts) -> str:
    """The platform facts for doctor (unknown ones say so)."""
    p = facts.platform

    def yes_no(v: bool | None) -> str:
        return "unknown" if v is None else "yes" if v else "no"

    rdma = (f"{p.rdma_link_layer} ({', '.join(p.rdma_devices) or 'no active port'})"
            if p.rdma_link_layer else "none active")
    master = dict(facts.env).get("MASTER_ADDR")
    route = (p.master_ifname or "unknown") if p.master_ifname or master else "not set"
    if master:
        route = f"{master} via {route}"
    if p.master_route:
        route += f" ({p.master_route})"
    fm = f", fabric manager {p.fabric_manager}" if p.fabric_manager else ""
    family = f" resolving to {p.master_family}" if p.master_family else ""
    return (f"Platform: NVSwitch {yes_no(p.nvswitch)}{fm}, hypervisor "
            f"{p.hypervisor or 'none seen'}, RDMA {rdma}, route to MASTER_ADDR: {route}{family}, "
            f"hostname on loopback {yes_no(p.hostname_loopback)}, NCCL net plugins "
            f"{', '.join(p.net_plugins) or 'none found'}, boot id {p.boot_id or 'unknown'}")


def simulate_file(path: Path, real_env: Mapping[str, str] | None = None,
                  probers: list[SimulatedProber] | None = None) -> dict[str, Any]:
    """What ``resilient-strategy plan --simulate PATH`` decides: a Selection per framework.
    ``probers``: where each framework's simulated prober is appended (its `clock` is the
    simulated seconds the decision spent probing, kept when the decision ends in an error)."""
    facts, sim = load_simulation(path)
    args = build_parser().parse_args(["plan", "--simulate", str(path)])
    return {fw: _decide(args, facts, sim, fw, real_env or {}, probers)
            for fw in _frameworks(facts, sim.get("framework"))}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:  # the supervisor takes torchrun's options: its own parser
        from .run.supervisor import main as run_main

        return run_main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "cache":
        return _cache_command(args, machine_env.snapshot())
    if args.logical_cpus and args.framework == "torch":
        parser.error("--logical-cpus is a TensorFlow test mode; it does not apply to torch")
    if args.nproc_per_node and args.framework == "tensorflow":
        parser.error("--nproc-per-node is for torch (one process per GPU); TensorFlow runs one")
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    # but a file or directory that is not safely yours is said (the cache is off meanwhile)
    logging.getLogger("resilient_strategy.files").setLevel(logging.WARNING)
    real_env = machine_env.snapshot()
    try:
        _check_disabled_rules(args, real_env)
        sim: dict[str, Any] | None = None
        if args.simulate:
            facts, sim = load_simulation(args.simulate)
        else:
            from .machine.inspect import detect_facts

            facts = detect_facts(real_env)
        frameworks = _frameworks(facts, args.framework or (sim or {}).get("framework"))
        selections = {fw: _decide(args, facts, sim, fw, real_env) for fw in frameworks}
    except ResilientStrategyError as exc:
        print(f"resilient_strategy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not selections and args.command == "probe":  # asked to prove, and nothing to prove
        print("resilient_strategy: nothing to probe: neither torch nor tensorflow is installed "
              "in this environment (pip install torch, or tensorflow).", file=sys.stderr)
        return EXIT_USAGE
    cached = _machine_cache(real_env, facts.fingerprint()) \
        if args.command == "doctor" and sim is None else None
    if args.json:
        _emit(json.dumps({
            "facts": facts.to_dict(),
            "fingerprint": facts.fingerprint(),
            "decisions": {fw: s.to_dict() for fw, s in selections.items()},
            **({"cache": cached} if cached is not None else {}),
            **({"binding": _binding_view(facts, selections.values())}
               if args.command == "doctor" else {}),
        }, indent=2, default=str))
        return EXIT_OK
    lines: list[str] = []
    if args.command == "doctor":
        lines += _facts_text(facts)
        fired = sorted({r for s in selections.values() for r in s.plan.rules_fired})
        lines += _launcher_lines(_binding_view(facts, selections.values()))
        lines.append("Rules fired: " + (", ".join(fired) if fired else "none"))
        differ = sorted({e.finding.id for s in selections.values() for e in s.plan.events
                         if e.kind == "nodes_differ"})
        if differ:  # a multi-node job's nodes compared (node_differences.toml)
            lines.append("Differences between the nodes: " + ", ".join(differ))
        if cached is not None:
            lines += _cache_lines(facts.fingerprint(), cached) if cached["entries"] else [
                f"Cache: nothing cached for this machine ({cached['path']})"]
            lines.append("  (`python -m resilient_strategy cache show` lists every machine's "
                         "entries; `cache clear` removes this machine's)")
    if not selections:
        lines.append("No plan: neither torch nor tensorflow is installed in this environment. "
                     "Install the one you train with (pip install torch, or tensorflow) and run "
                     "this again, or plan for a described machine with --simulate FILE.")
    for fw, sel in selections.items():
        lines += ["", f"== {fw} ==", f"({'Planned' if args.command != 'probe' else 'Decided'} "
                  f"{launch_words(sel)}{'' if args.nproc_per_node else _LAUNCH_HINT[fw]}.)",
                  *_selection_text(sel, show_probes=args.command == "probe")]
    _emit("\n".join(lines))
    return EXIT_OK


def _emit(text: str) -> None:
    """Print the report; a reader that left (``| head``) is not an error of ours."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
