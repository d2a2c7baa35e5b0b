"""``resilient-strategy run``'s command line: torchrun's own parser and options, ours added, into
one `RunOptions`; the framework a script uses, guessed from its text.

Without torch (a TensorFlow-only install) the parser is our own: the script, its arguments,
``--nproc-per-node`` and our options, the same names and defaults; torchrun's node options
(``--nnodes``, ``--rdzv-*``, ...) are torch's and absent there.

Started by srun (one task per node, no torchrun): the node options the user did not give come
from SLURM (`srun_launch`: nodes, node rank, the rendezvous across nodes, GPUs per node); two
or more srun tasks of run on one node are refused (`SrunTasksError`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from ..core.call.arguments import WARM_START_VAR, env_flag, run_options_from
from ..core.call.fields import RUN_FIELDS
from ..core.call.options import RunOptions
from ..core.values.launcher import RUN_NODE_OPTIONS, RunLaunch, run_launch
from ..errors import InvalidOptionError, SrunTasksError
from ..machine import env

log = logging.getLogger("resilient_strategy")


def guess_framework(script_text: str) -> str | None:
    """The framework a script trains with, from its text (None when it does not say)."""
    m = re.search(r"framework\s*=\s*[\"'](tensorflow|tf|keras|torch|pytorch)[\"']", script_text)
    if m:
        return {"tf": "tensorflow", "keras": "tensorflow", "pytorch": "torch"}.get(
            m.group(1), m.group(1))
    tf = re.search(r"^\s*(import|from)\s+(tensorflow|keras)\b", script_text, re.MULTILINE)
    torch = re.search(r"^\s*(import|from)\s+torch\b", script_text, re.MULTILINE)
    if bool(tf) != bool(torch):
        return "tensorflow" if tf else "torch"
    return None

@functools.cache
def torch_launcher() -> bool:
    """torch's elastic agent (and torchrun's parser) can be imported here."""
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True


_DESCRIPTION = ("Run a training script on the strategy that works here and keep it running: "
                "relaunch on the next candidate when a collective fails or stalls mid-run.")


def parser(with_torch: bool | None = None) -> argparse.ArgumentParser:
    """torchrun's parser plus ours where torch is installed (``with_torch`` None: when
    `torch_launcher`), else `own_parser`."""
    if not (torch_launcher() if with_torch is None else with_torch):
        return own_parser()
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "resilient-strategy run"
    p.description = _DESCRIPTION + " Takes torchrun's options."
    return _ours(p)


def own_parser() -> argparse.ArgumentParser:
    """The parser without torch: the script and its arguments, ``--nproc-per-node`` (as
    torchrun spells it, both ways) and our options."""
    p = argparse.ArgumentParser(
        prog="resilient-strategy run",
        description=_DESCRIPTION + " torch is not installed: TensorFlow scripts run as one "
        "supervised process (torchrun's node options need torch).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1",
                   help="processes per node for a torch script (a count or 'auto'); a "
                        "TensorFlow script runs one process that drives every device")
    _ours(p)
    p.add_argument("training_script", help="the training script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER,
                   help="the script's own arguments")
    return p


def _ours(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags, each from its field (`core.call.fields.RUN_FIELDS`: flag, type, range,
    default and help described once)."""
    for f in RUN_FIELDS:
        f.add_to(p)
    return p


def options_from_args(argv: Sequence[str]) -> RunOptions:
    """Parse ``resilient-strategy run`` arguments (torchrun's, plus ours; ours alone without
    torch)."""
    with_torch = torch_launcher()
    p = parser(with_torch)
    p.error = _one_line_error  # type: ignore[method-assign]  # not torchrun's 39-line usage
    ns = p.parse_args(list(argv))
    if getattr(ns, "module", False) or getattr(ns, "no_python", False) or getattr(
            ns, "run_path", False):
        raise InvalidOptionError("resilient-strategy run runs a Python script file; -m, "
                                 "--no-python and --run-path are not supported")
    script = str(ns.training_script)
    ours = list(argv)[:list(argv).index(script)] if script in argv else list(argv)
    if with_torch and not any(t.split("=")[0] in ("--master-port", "--master_port")
                              for t in ours):
        # not given: None, as torch >= 2.12's parser says (2.11's says 29500), so that a
        # one-node run takes a free port (standalone) and two jobs on a machine do not collide
        ns.master_port = None
    launch = srun_launch(ours, env.snapshot())
    if with_torch:
        apply_launch(ns, launch)
        check_node_options(ns)
    warm = _warm_start(ns, ours)
    framework = ns.framework
    if framework is None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            framework = guess_framework(Path(script).read_text(encoding="utf-8"))
    if framework == "torch" and not with_torch:
        raise InvalidOptionError("a torch script needs torch: its workers run under torch's "
                                 "elastic agent (pip install torch); without it, run "
                                 "supervises TensorFlow scripts", "--framework")
    opts = run_options_from(
        env.snapshot(), script=script, script_args=tuple(ns.training_script_args),
        framework=framework,
        nproc=str(ns.nproc_per_node if launch.nproc is None else launch.nproc),
        max_relaunches=ns.max_relaunches,
        stall_timeout=ns.stall_timeout, global_batch_size=ns.global_batch_size,
        gradient_bytes=ns.gradient_bytes, probe_timeout=ns.probe_timeout,
        logical_cpus=ns.logical_cpus, torchrun=ns if with_torch else None, sharding=ns.sharding,
        param_bytes=ns.param_bytes, optimizer_state_factor=ns.optimizer_state_factor,
        offload=ns.offload, busy_timeout=ns.busy_timeout, warm_start=warm,
        measured_switch=ns.measured_switch)
    return replace(opts, run_launch=launch, min_throughput=ns.min_throughput,
                   allow_cpu=bool(ns.allow_cpu),
                   max_attempts_without_progress=ns.max_attempts_without_progress,
                   fault_window=ns.fault_window, evidence_dir=ns.evidence_dir)  # validated by RunOptions, as every option


def given_node_options(ours: Sequence[str]) -> frozenset[str]:
    """The `RUN_NODE_OPTIONS` on run's own part of the command line (either spelling)."""
    names = {t.split("=")[0].replace("_", "-") for t in ours if t.startswith("--")}
    return frozenset(n for n in RUN_NODE_OPTIONS if n in names)


def srun_launch(ours: Sequence[str], snapshot: Mapping[str, str]) -> RunLaunch:
    """Who started run, and the node options SLURM gives where the user gave none
    (`core.values.launcher.run_launch`); more than one srun task of run on this node is a
    `SrunTasksError`."""
    from ..machine.scontrol import detect_launcher

    launch = run_launch(detect_launcher(snapshot), snapshot, given_node_options(ours))
    if launch.refused:
        raise SrunTasksError(launch.tasks_per_node, launch.tasks_source)
    return launch


def apply_launch(ns: argparse.Namespace, launch: RunLaunch) -> None:
    """torchrun's parsed node options with the values read from SLURM (only those the user
    did not give: `run_launch` leaves theirs None)."""
    if launch.nnodes is not None:
        ns.nnodes = str(launch.nnodes)
    if launch.node_rank is not None:
        ns.node_rank = launch.node_rank
    if launch.master_addr is not None:
        ns.master_addr = launch.master_addr
    if launch.master_port is not None:
        ns.master_port = launch.master_port


#: The start method of a warm start (run/warm.py): torch's agent starts a function entry point
#: with it (torchrun's ``--start-method``, which a script entry point ignores).
WARM_START_METHOD = "forkserver"


def _warm_start(ns: argparse.Namespace, ours: Sequence[str]) -> bool | None:
    """``--warm-start`` as given (None: not given, the environment or the default decides).
    A warm start forks its workers through torch's ``forkserver`` start method: a
    ``--start-method`` the user gave that is another one turns it off, and asking for both is
    an error (the user's argument is never overridden)."""
    warm: bool | None = ns.warm_start
    given = next((t for t in ours if t.split("=")[0] in ("--start-method", "--start_method")),
                 None)
    method = str(getattr(ns, "start_method", WARM_START_METHOD))
    if given is None or method == WARM_START_METHOD or warm is False:
        return warm
    if warm or env_flag(env.snapshot(), WARM_START_VAR, False):
        raise InvalidOptionError(
            f"--start-method {method} and a warm start (--warm-start or {WARM_START_VAR}=1) "
            f"disagree: a warm start forks its workers with {WARM_START_METHOD}; drop one of "
            "them", "--start-method")
    return False


def _one_line_error(message: str) -> NoReturn:
    """argparse's error as one line, raised as a typed error (argparse prints the whole usage
    first, and torchrun's is 39 lines)."""
    if "training_script" in message and "required" in message:
        message = "no script given: resilient-strategy run [options] SCRIPT [ARGS...]"
    raise InvalidOptionError(f"{message} (resilient-strategy run --help lists the options)")


def node_count(opts: RunOptions) -> int:
    ns = opts.torchrun
    if ns is None:
        return 1
    text = str(getattr(ns, "nnodes", "1"))
    return int(text.split(":")[-1])


def _port(text: str) -> int | None:
    return int(text) if text.isdigit() and 0 <= int(text) <= 65535 else None


def check_node_options(ns: argparse.Namespace) -> None:
    """torchrun's node options, checked before torch reads them: a bad one is one line naming
    the flag and what was typed (torch's own parser lets them through to a traceback)."""
    nnodes = str(getattr(ns, "nnodes", "1"))
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or (
            len(parts) == 2 and int(parts[0]) > int(parts[1])):
        raise InvalidOptionError(f"--nnodes must be a node count N or a range MIN:MAX of "
                                 f"positive integers, not {nnodes!r}", "--nnodes")
    port = getattr(ns, "master_port", None)
    if port is not None and _port(str(port)) is None:
        raise InvalidOptionError(f"--master-port must be a port from 0 to 65535, not {port!r}",
                                 "--master-port")
    rank = getattr(ns, "node_rank", 0)
    if not str(rank).isdigit():
        raise InvalidOptionError(f"--node-rank must be an integer from 0, not {rank!r}",
                                 "--node-rank")
    endpoint = str(getattr(ns, "rdzv_endpoint", "") or "")
    if endpoint:
        host, sep, tail = endpoint.rpartition(":")
        if endpoint.startswith("["):  # [IPv6]:port or [IPv6]
            close = endpoint.find("]")
            host, tail = endpoint[1:close], endpoint[close + 2:] if close >= 0 else ""
            sep = ":" if tail else ""
            bad = close < 0 or not host
        elif not sep:
            host, bad = endpoint, False
        else:
            bad = not host or ":" in host
        if bad or (sep and _port(tail) is None):
            raise InvalidOptionError(
                f"--rdzv-endpoint must be HOST or HOST:PORT (an IPv6 host in brackets, a port "
                f"from 0 to 65535), not {endpoint!r}", "--rdzv-endpoint")
