"""Fake machines and probe outcomes for users' unit tests and ours."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..facts import Facts, FrameworkInfo, Gpu, Host, Link, Visibility
from ..probe import CAUSES, ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
from ..selection import Selection


def gpu(
    index: int = 0,
    name: str = "NVIDIA H200",
    cc: tuple[int, int] = (9, 0),
    memory_gb: float = 141,
    *,
    mig: bool = False,
) -> Gpu:
    """One fake GPU (index as the job sees it)."""
    return Gpu(
        index=index, name=name, compute_capability=cc, memory_bytes=int(memory_gb * 2**30),
        uuid=f"GPU-fake-{index:04d}", pci_bus_id=f"00000000:{index + 1:02x}:00.0",
        physical_index=index, mig_enabled=mig,
    )


def machine(
    gpus: int | Sequence[Gpu] = 2,
    *,
    name: str = "NVIDIA H200",
    cc: tuple[int, int] = (9, 0),
    memory_gb: float = 141,
    nvlink: int = 0,
    p2p: str = "ok",
    topology: str = "hostbridge",
    shm_mb: int | None = 65536,
    container: str = "",
    wsl2: bool = False,
    sagemaker: bool = False,
    aws: bool = False,
    efa: bool = False,
    iommu: str = "unknown",
    torch: str | None = "2.11.0",
    torch_cuda: str | None = "13.0",
    torch_nccl: str | None = "2.28.9",
    torch_archs: Sequence[str] = (),
    tensorflow: str | None = None,
    tf_cuda: str | None = None,
    tf_archs: Sequence[str] = (),
    tf_nccl: str | None = None,
    keras: str | None = None,
    driver: str | None = "580.159.04",
    env: Mapping[str, str] | None = None,
    nvml_error: str | None = None,
) -> Facts:
    """Facts for a described machine. ``nvlink`` is the number of NVLinks between each pair."""
    gs = tuple(gpu(i, name, cc, memory_gb) for i in range(gpus)) if isinstance(gpus, int) \
        else tuple(gpus)
    links = tuple(
        Link(a.index, b.index, topology=topology, nvlinks=nvlink, p2p_read=p2p,
             p2p_nvlink="ok" if nvlink else "not_supported")
        for i, a in enumerate(gs) for b in gs[i + 1:]
    )
    fws = []
    if torch:
        fws.append(FrameworkInfo("torch", torch, "torch", torch_cuda, torch_nccl, tuple(torch_archs)))
    if tensorflow:
        dist = "tensorflow" if tf_cuda else "tensorflow-cpu"
        fws.append(FrameworkInfo("tensorflow", tensorflow, dist, tf_cuda, tf_nccl, tuple(tf_archs)))
    if keras:
        fws.append(FrameworkInfo("keras", keras, "keras"))
    env = dict(env or {})
    return Facts(
        gpus=gs,
        links=links,
        driver_version=driver if gs else None,
        cuda_driver_version="13.0" if gs else None,
        nvml_error=nvml_error if nvml_error or gs else "no GPU in this description",
        visibility=Visibility(raw=env.get("CUDA_VISIBLE_DEVICES"),
                              physical=tuple(g.physical_index for g in gs)),
        host=Host(shm_bytes=None if shm_mb is None else shm_mb << 20, container=container,
                  wsl2=wsl2, sagemaker=sagemaker, aws=aws, efa=efa, iommu=iommu,
                  kernel="6.8.0", cpu_count=32),
        frameworks=tuple(fws),
        env=tuple(sorted(env.items())),
    )


Outcome = str | ProbeResult  # "ok", "ok:<GB/s>", "timeout", "error:<cause>", or a result


@dataclass
class FakeProber:
    """Answers probes from a table instead of running them, and records what was asked.

    Keys: a backend with no extra environment ("nccl", "gloo", "hierarchical_copy", ...); a
    backend with the exact environment of a remedy ("nccl+NCCL_P2P_DISABLE=1", several sorted
    and joined by ","); "nccl+*" for every remedy; "*" for everything. The most specific key
    wins; anything unmatched is ``default``.
    """

    outcomes: Mapping[str, Outcome] = field(default_factory=dict)
    default: Outcome = "ok"
    calls: list[ProbeSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key, out in self.outcomes.items():
            _parse(key, out)  # validate early: a typo is an error, not a silent "ok"

    def __call__(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        self.calls.append(spec)
        env_key = ",".join(f"{k}={v}" for k, v in spec.env)
        keys = [f"{spec.backend}+{env_key}", f"{spec.backend}+*"] if env_key else [spec.backend]
        for key in (*keys, "*"):
            if key in self.outcomes:
                return _parse(spec.candidate, self.outcomes[key])
        return _parse(spec.candidate, self.default)

    @property
    def probed(self) -> list[str]:
        """What was probed, in order, as "backend" or "backend+ENV=1"."""
        return [
            s.backend + ("+" + ",".join(f"{k}={v}" for k, v in s.env) if s.env else "")
            for s in self.calls
        ]


def _parse(candidate: str, out: Outcome) -> ProbeResult:
    if isinstance(out, ProbeResult):
        return ProbeResult.from_dict({**out.to_dict(), "candidate": candidate})
    kind, _, arg = out.partition(":")
    if kind == OK:
        bw = float(arg) if arg else None
        return ProbeResult(candidate, OK, 2.0, bus_bandwidth_gbps=bw, detail="simulated")
    if kind == TIMEOUT:
        return ProbeResult(candidate, TIMEOUT, 30.0, "timeout", "simulated hang")
    if kind == ERROR and arg in CAUSES:
        return ProbeResult(candidate, ERROR, 1.0, arg, "simulated failure")
    raise ValueError(
        f"probe outcome {out!r}: use 'ok', 'ok:<GB/s>', 'timeout' or 'error:<cause>' with a "
        f"cause in {sorted(c for c in CAUSES if c)}"
    )


def simulate(
    facts: Facts,
    outcomes: Mapping[str, Outcome] | FakeProber | None = None,
    **kwargs: Any,
) -> Selection:
    """Run ``resilient_strategy()`` for described facts with simulated probe outcomes.

    Uses the facts' own env (never ``os.environ``), no cache unless asked, and sets nothing.
    """
    from ..executor import resilient_strategy

    prober = outcomes if isinstance(outcomes, FakeProber) else FakeProber(dict(outcomes or {}))
    kwargs.setdefault("cache", False)
    kwargs.setdefault("env", facts.env_map)
    return resilient_strategy(facts=facts, _prober=prober, **kwargs)
