"""The fact language of the data tables: the facts a clause can name (`FACT_NAMES`, computed by
`fact_values` from `Facts`), a ``when`` clause parsed (`parse_clause`) and judged
(`clause_holds`), and a message's ``{fact}`` filled in. Rules and remedies both read it.

Clauses read ``<fact> <op> <value>``, e.g. ``"tensorflow.version < 2.20"`` or
``"gpus.names matches RTX 50"``; a bare ``"host.wsl2"`` means true, ``"not host.wsl2"`` false. A
fact name that is not in `FACT_NAMES` (or ``env.<VARIABLE>``) is an error when the table is
loaded; a known fact whose value is unknown on this machine makes the clause false. Pure.
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

from ...errors import InvalidRuleError
from ..values.facts import Facts, Gpu, Host, LinkSummary

_OPS = ("<=", ">=", "==", "!=", "<", ">", "matches", "contains", "in")


_CLAUSE = re.compile(
    r"^\s*(?P<neg>not\s+)?(?P<fact>[a-z_]+\.[A-Za-z0-9_]+|framework)"
    r"(?:\s*(?P<op><=|>=|==|!=|<|>)\s*|\s+(?P<wop>matches|contains|in)\s+|$)"
    r"(?P<value>.*?)\s*$"
)


_FRAMEWORK_FACTS = ("installed", "version", "cuda", "nccl", "max_arch", "imported", "gpu_kernels",
                    "build", "hip")


#: Every fact a clause can name (what `fact_values` computes), besides ``env.<VARIABLE>``.
FACT_NAMES: tuple[str, ...] = (
    "framework",
    "gpus.count", "gpus.names", "gpus.min_cc", "gpus.max_cc", "gpus.consumer", "gpus.mig",
    "gpus.mixed", "gpus.nvlinks_outside", "gpus.numa_nodes",
    "links.all_nvlink", "links.any_pcie_only", "links.p2p_unsupported", "links.cross_socket",
    "links.any_nvlink", "links.any_switch", "links.any_host_path",
    "driver.version", "driver.cuda", "driver.older_than_build", "driver.cuda_major_behind",
    "plan.replicas", "plan.nodes", "nccl.version",
    "platform.nvswitch", "platform.hypervisor", "platform.vm", "platform.rdma_link_layer",
    "platform.rdma_devices", "platform.rdma_count", "platform.master_ifname",
    "platform.hostname_loopback", "platform.fabric_manager", "platform.fabric_manager_mismatch",
    "host.shm_mb", "host.container", "host.in_container", "host.wsl2", "host.sagemaker",
    "host.aws", "host.efa", "host.infiniband", "host.iommu", "host.platform",
    "host.machine", "host.mps", "host.numa_nodes", "host.numa_memory_only", "host.amd_gpus",
    "host.cuda_compat", "host.port_range", "host.master_port_by",
    "host.master_port_ephemeral",
    *(f"{fw}.{name}" for fw in ("torch", "tensorflow", "keras") for name in _FRAMEWORK_FACTS),
)


FactValue = str | int | bool | Version | tuple[str, ...] | None


_ORDER_OPS = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt,
    ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}


@dataclass(frozen=True)
class Clause:
    fact: str
    op: str  # one of _OPS, or "truthy"
    value: str
    negate: bool = False
    #: the compiled regular expression of a ``matches`` clause (compiled when the rule loads)
    pattern: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        neg = "not " if self.negate else ""
        return f"{neg}{self.fact}" if self.op == "truthy" else f"{self.fact} {self.op} {self.value}"


def parse_clause(text: str, rule_id: str = "?", origin: str = "") -> Clause:
    """Read one ``when`` clause; every problem is an `InvalidRuleError` naming the rule
    (and ``origin``, the file it came from)."""
    m = _CLAUSE.match(text)
    if not m:
        raise InvalidRuleError(
            rule_id, f"cannot read clause {text!r}; expected '<fact> <op> <value>'", origin)
    fact = m.group("fact")
    _check_fact(fact, text, rule_id, origin)
    op = m.group("op") or m.group("wop")
    raw = m.group("value").strip()
    value = raw.strip("'\"")
    if op is None:
        if raw:
            raise InvalidRuleError(rule_id, f"clause {text!r} has a value but no operator", origin)
        op = "truthy"
    elif not raw:
        raise InvalidRuleError(rule_id, f"clause {text!r} has no value after {op!r}", origin)
    pattern = None
    if op == "matches":
        try:
            pattern = re.compile(value, re.IGNORECASE)
        except re.error as exc:
            raise InvalidRuleError(
                rule_id, f"clause {text!r}: {value!r} is not a valid regular expression ({exc})",
                origin,
            ) from exc
    return Clause(fact=fact, op=op, value=value, negate=bool(m.group("neg")), pattern=pattern)


def _check_fact(fact: str, text: str, rule_id: str, origin: str) -> None:
    if fact in FACT_NAMES or (fact.startswith("env.") and len(fact) > len("env.")):
        return
    close = difflib.get_close_matches(fact, FACT_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise InvalidRuleError(
        rule_id,
        f"clause {text!r} names unknown fact {fact!r}{hint}; valid facts: "
        f"{', '.join(FACT_NAMES)}, env.<VARIABLE>",
        origin,
    )


# --------------------------------------------------------------------------------------------
# Facts as named values
# --------------------------------------------------------------------------------------------
def _version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text.split("+")[0])
    except InvalidVersion:
        return None


def _max_arch(archs: Sequence[str]) -> Version | None:
    """Highest compute capability in an arch list like ("sm_89", "compute_90") -> 9.0."""
    best: Version | None = None
    for a in archs:
        m = re.search(r"(\d+)(\d)[a-z]?$", a)
        if m:
            v = Version(f"{m.group(1)}.{m.group(2)}")
            best = v if best is None or v > best else best
    return best


def _kernel_coverage(archs: Sequence[str], gpus: Sequence[Gpu]) -> str | None:
    """"native" when every GPU has SASS of its major with minor <= its own, "ptx_jit" when some
    GPU can run only by JIT-compiling PTX of an older arch, "none" when some GPU has neither;
    None when the arch list is unknown or there are no GPUs."""
    if not archs or not gpus:
        return None
    sass: list[tuple[int, int]] = []
    ptx: list[tuple[int, int]] = []
    for a in archs:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", a.strip())
        if m:
            (sass if m.group(1) == "sm" else ptx).append((int(m.group(2)), int(m.group(3))))
    worst = "native"
    for g in gpus:
        major, minor = g.compute_capability
        if (major, minor) == (0, 0):  # NVML could not read it: no verdict on this GPU
            continue
        if any(s[0] == major and s[1] <= minor for s in sass):
            continue
        if any(p <= (major, minor) for p in ptx):
            worst = "ptx_jit"
            continue
        return "none"
    return worst


def fact_values(facts: Facts, framework: str, replicas: int | None = None,
                nodes: int | None = None) -> dict[str, FactValue]:
    """Every name a rule clause can use, computed from the facts (pure); ``replicas`` and
    ``nodes`` are the planner's ``plan.replicas`` / ``plan.nodes`` (None, unknown, outside a
    plan)."""
    values: dict[str, FactValue] = {
        "framework": framework,
        "plan.replicas": replicas,
        **_gpu_values(facts.gpus),
        **_link_values(facts.link_summary()),
        "plan.nodes": nodes,
        "nccl.version": _version(facts.framework(framework).nccl),
        **_platform_values(facts),
        "driver.version": _version(facts.driver_version),
        "driver.cuda": _version(facts.cuda_driver_version),
        **_host_values(facts.host),
    }
    for fw in ("torch", "tensorflow", "keras"):
        values.update(_framework_values(facts, fw))
    values.update(_driver_build_values(values, framework))
    h = facts.host
    # a port the launcher picked (the kernel gave it, its store already listens there) is no
    # port the user can move below the range: only one the user chose is named
    values["host.master_port_ephemeral"] = (
        False if h.master_port_by == "launcher"
        else _in_port_range(facts.env_map.get("MASTER_PORT"), h.port_range))
    for name, value in facts.env:
        values[f"env.{name}"] = value
    return values


def _gpu_values(gpus: tuple[Gpu, ...]) -> dict[str, FactValue]:
    """The ``gpus.*`` facts."""
    ccs = [Version(g.cc) for g in gpus if g.compute_capability != (0, 0)]  # (0, 0): unread
    return {
        "gpus.count": len(gpus),
        "gpus.names": tuple(g.name for g in gpus),
        "gpus.min_cc": min(ccs) if ccs else None,
        "gpus.max_cc": max(ccs) if ccs else None,
        "gpus.consumer": any(g.is_consumer for g in gpus),
        "gpus.mig": any(g.mig_enabled for g in gpus),
        "gpus.mixed": len({(g.name, g.memory_bytes) for g in gpus}) > 1,
        "gpus.nvlinks_outside": sum(g.nvlinks_outside for g in gpus),
        # the NUMA nodes the GPUs hang off (None: some GPU's node is unknown)
        "gpus.numa_nodes": (len({g.numa_node for g in gpus})
                            if gpus and all(g.numa_node is not None for g in gpus) else None),
    }


def _link_values(links: LinkSummary) -> dict[str, FactValue]:
    """The ``links.*`` facts."""
    return {
        "links.all_nvlink": links.all_nvlink,
        "links.any_pcie_only": links.any_pcie_only,
        "links.p2p_unsupported": links.p2p_unsupported,
        "links.cross_socket": links.cross_socket,
        "links.any_nvlink": links.any_nvlink,
        "links.any_switch": links.any_switch,
        "links.any_host_path": links.any_host_path,
    }


def _platform_values(facts: Facts) -> dict[str, FactValue]:
    """The ``platform.*`` facts."""
    p = facts.platform
    return {
        "platform.nvswitch": p.nvswitch,
        "platform.hypervisor": p.hypervisor,
        "platform.vm": bool(p.hypervisor),
        "platform.rdma_link_layer": p.rdma_link_layer,
        "platform.rdma_devices": p.rdma_devices,
        "platform.rdma_count": len(p.rdma_devices),
        "platform.fabric_manager": p.fabric_manager,
        "platform.fabric_manager_mismatch": (
            None if not p.fabric_manager or not facts.driver_version
            else p.fabric_manager != facts.driver_version),
        "platform.master_ifname": p.master_ifname,
        "platform.hostname_loopback": p.hostname_loopback,
    }


def _host_values(h: Host) -> dict[str, FactValue]:
    """The ``host.*`` facts read from the host (``host.master_port_ephemeral`` apart)."""
    return {
        "host.shm_mb": None if h.shm_bytes is None else h.shm_bytes // (1 << 20),
        "host.container": h.container,
        "host.in_container": bool(h.container),
        "host.wsl2": h.wsl2,
        "host.sagemaker": h.sagemaker,
        "host.aws": h.aws,
        "host.efa": h.efa,
        "host.infiniband": h.infiniband,
        "host.iommu": h.iommu,
        "host.platform": h.platform,
        "host.machine": h.machine,
        # Apple silicon under macOS: PyTorch's MPS device (one GPU, no collective backend)
        "host.mps": h.platform == "darwin" and h.machine in ("arm64", "aarch64"),
        "host.numa_nodes": h.numa_nodes,
        "host.numa_memory_only": h.numa_memory_only,
        "host.amd_gpus": h.amd_gpus,
        "host.cuda_compat": h.cuda_compat,
        "host.port_range": h.port_range,
        "host.master_port_by": h.master_port_by,
    }


def _framework_values(facts: Facts, fw: str) -> dict[str, FactValue]:
    """The ``<fw>.*`` facts of one framework."""
    info = facts.framework(fw)
    return {
        f"{fw}.installed": info.installed,
        f"{fw}.version": _version(info.version),
        f"{fw}.cuda": _version(info.cuda),
        f"{fw}.nccl": _version(info.nccl),
        f"{fw}.max_arch": _max_arch(info.archs),
        f"{fw}.imported": info.imported,
        f"{fw}.gpu_kernels": _kernel_coverage(info.archs, facts.gpus),
        f"{fw}.build": info.build,
        f"{fw}.hip": _version(info.hip),
    }


def _driver_build_values(values: Mapping[str, FactValue], framework: str
                         ) -> dict[str, FactValue]:
    """``driver.older_than_build`` / ``driver.cuda_major_behind``: the driver against the CUDA
    the framework was built with (None: either unknown)."""
    build = values.get(f"{framework}.cuda") if framework in ("torch", "tensorflow") else None
    driver_cuda = values["driver.cuda"]
    if not (isinstance(build, Version) and isinstance(driver_cuda, Version)):
        return {"driver.older_than_build": None, "driver.cuda_major_behind": None}
    return {
        "driver.older_than_build": driver_cuda < Version(f"{build.major}.{build.minor}"),
        # CUDA 11+ runs a build on any driver of its major release (minor version
        # compatibility); a driver of an older major release cannot run it at all
        # (cudaErrorInsufficientDriver)
        "driver.cuda_major_behind": driver_cuda.major < build.major,
    }


def _in_port_range(port: str | None, port_range: str) -> bool | None:
    """Whether ``port`` lies in the kernel's ephemeral range "low-high"; None: either unknown."""
    low, _, high = port_range.partition("-")
    if not (port or "").strip().isdigit() or not low.isdigit() or not high.isdigit():
        return None
    return int(low) <= int(str(port).strip()) <= int(high)


_MESSAGE_FACT = re.compile(r"\{([a-z_]+\.[A-Za-z0-9_]+)\}")


def fill_message(message: str, values: Mapping[str, FactValue]) -> str:
    """A rule's message with each ``{fact}`` replaced by this machine's value (so the advice
    names the version it is about); an unknown fact reads "unknown"."""

    def value(m: re.Match[str]) -> str:
        v = values.get(m.group(1))
        if v is None or v == "":
            return "unknown"
        return ",".join(v) if isinstance(v, tuple) else str(v)

    return _MESSAGE_FACT.sub(value, message)


def _compare(
    actual: FactValue, op: str, raw: str, pattern: re.Pattern[str] | None = None
) -> bool | None:
    """None when the comparison cannot be made (unknown fact or incomparable value)."""
    if actual is None:
        return None
    if op == "matches":
        items = actual if isinstance(actual, tuple) else (str(actual),)
        rx = pattern or re.compile(raw, re.IGNORECASE)
        return any(rx.search(str(i)) for i in items)
    if op == "contains":
        items = actual if isinstance(actual, tuple) else (str(actual),)
        return raw in items if isinstance(actual, tuple) else raw in str(actual)
    if op == "in":
        options = [o.strip().strip("'\"") for o in raw.strip("[]").split(",")]
        return str(actual) in options
    expected: Any
    value: Any = actual
    if isinstance(actual, bool):
        expected = raw.lower() in ("true", "1", "yes")
    elif isinstance(actual, int):
        try:
            expected = int(raw)
        except ValueError:
            return None
    elif isinstance(actual, Version):
        expected = _version(raw)
        if expected is None:
            return None
    elif isinstance(actual, tuple):
        return None
    else:
        expected, value = raw, str(actual)
    if isinstance(value, bool) and op not in ("==", "!="):
        return None
    return bool(_ORDER_OPS[op](value, expected))


def clause_holds(clause: Clause, values: Mapping[str, FactValue]) -> bool:
    """Whether a clause holds; a clause on an unknown fact never holds (negated or not)."""
    if clause.fact.startswith("env.") and clause.fact not in values:
        actual: FactValue = ""  # an unset variable reads as empty
    else:
        actual = values.get(clause.fact)
    if clause.op == "truthy":
        if actual is None:
            return False
        result: bool | None = bool(actual)
    else:
        result = _compare(actual, clause.op, clause.value, clause.pattern)
    if result is None:
        return False
    return result != clause.negate
