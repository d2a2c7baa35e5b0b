"""How CUDA resolves ``CUDA_VISIBLE_DEVICES`` against the physical GPUs. Pure: no NVML, no os.

CUDA's rules (https://docs.nvidia.com/cuda/cuda-c-programming-guide/#cuda-environment-variables):
a comma-separated list of indices or ``GPU-<uuid>`` strings (a unique UUID prefix is enough);
enumeration stops at the first invalid entry, keeping the ones before it, so ``0,2,-1,1`` shows
GPUs 0 and 2. The finer points follow PyTorch's mirror of CUDA's parser
(``torch.cuda._parse_visible_devices``): indices are read like ``strtoul`` (``1a`` is 1), the
first entry decides whether the list holds indices or UUIDs, UUID prefixes are case-sensitive,
and a device named twice hides every GPU. MIG instances are named ``MIG-<uuid>`` (or, before driver R470,
``MIG-GPU-<uuid>/<gpu instance>/<compute instance>``), and a CUDA process enumerates only one MIG
instance (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/#cuda-visible-devices).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.values.facts import Gpu, Link, Visibility

_INDEX = re.compile(r"[+-]?\d+")

_LEGACY_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)")


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance of a physical GPU."""

    uuid: str  # "MIG-..."
    name: str = ""
    memory_bytes: int = 0
    gpu_instance: int = -1
    compute_instance: int = -1


@dataclass(frozen=True)
class PhysicalGpu:
    """A GPU as NVML lists it; ``index`` is the NVML index (nvidia-smi's numbering)."""

    index: int
    uuid: str = ""
    name: str = "unknown"
    compute_capability: tuple[int, int] = (0, 0)
    memory_bytes: int = 0
    pci_bus_id: str = ""
    mig_enabled: bool = False
    mig: tuple[MigDevice, ...] = ()
    memory_free_bytes: int | None = None  # None: unknown
    #: active NVLinks to GPUs NVML does not list here (a container given some of the GPUs)
    nvlinks_outside: int = 0


@dataclass(frozen=True)
class VisibleDevice:
    """One device the job sees, in job order: a whole GPU, or one MIG instance of it."""

    physical: int
    mig: MigDevice | None = None


@dataclass(frozen=True)
class Resolution:
    visibility: Visibility
    devices: tuple[VisibleDevice, ...]


def parse_visible_devices(
    raw: str | None, gpus: Sequence[PhysicalGpu], *, device_order: str | None = None
) -> Visibility:
    """Resolve ``CUDA_VISIBLE_DEVICES`` (``None`` = unset) to NVML indices in job order."""
    return resolve_visible_devices(raw, gpus, device_order=device_order).visibility


def resolve_visible_devices(
    raw: str | None, gpus: Sequence[PhysicalGpu], *, device_order: str | None = None
) -> Resolution:
    """Like `parse_visible_devices`, also naming the MIG instance behind each device."""
    ordered = sorted(gpus, key=lambda g: g.index)
    notes: list[str] = []
    if raw is None:
        picked = [VisibleDevice(g.index) for g in ordered]
    elif not raw.strip():
        picked = []
        notes.append("CUDA_VISIBLE_DEVICES is set but empty: CUDA sees no GPU")
    else:
        picked = _walk(raw.split(","), ordered, notes)
    by_index = {g.index: g for g in ordered}
    for dev in picked:
        gpu = by_index[dev.physical]
        if dev.mig is None and gpu.mig_enabled:
            notes.append(
                f"GPU {gpu.index} has MIG enabled: CUDA runs on one MIG instance of it, not on the "
                "whole GPU; name the instance (MIG-<uuid> from `nvidia-smi -L`) to be explicit"
            )
    names = sorted({g.name for g in ordered})
    if device_order != "PCI_BUS_ID" and len(names) > 1:
        notes.append(
            f"CUDA_DEVICE_ORDER is not PCI_BUS_ID and the GPUs differ ({', '.join(names)}): CUDA "
            "numbers the fastest GPU first, so its indices may not match nvidia-smi's (used here); "
            "set CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
    vis = Visibility(raw=raw, physical=tuple(d.physical for d in picked), notes=tuple(notes))
    return Resolution(vis, tuple(picked))


def visible_problem(vis: Visibility, *, has_gpus: bool = True) -> str | None:
    """Why the value is clearly a mistake (names GPUs, yet none resolve), else ``None``.

    An empty value, or one starting with a negative index (``-1``), hides GPUs on purpose.
    """
    raw = vis.raw
    if raw is None or vis.physical or not has_gpus or not raw.strip():
        return None
    first = raw.split(",")[0].strip()
    if _INDEX.fullmatch(first) and int(first) < 0:
        return None
    why = vis.notes[0] if vis.notes else "it names no GPU"
    return f"no GPU matches it ({why})"


def _walk(entries: list[str], gpus: list[PhysicalGpu], notes: list[str]) -> list[VisibleDevice]:
    """Enumerate as CUDA does (mirrored by PyTorch's ``torch.cuda._parse_visible_devices``):
    the first entry fixes the list's kind (``GPU-`` UUIDs, ``MIG-`` UUIDs, or ordinals read like
    ``strtoul``: leading digits, so ``1a`` is 1); the first entry that is not of that kind, or
    that matches nothing, ends the list; a device named twice makes the whole list empty."""
    first = entries[0].strip()
    kind = "GPU-" if first.startswith("GPU-") else "MIG-" if first.startswith("MIG-") else ""
    picked: list[VisibleDevice] = []
    for pos, item in enumerate(entries):
        entry = item.strip()
        dev, why = _match(entry, kind, gpus)
        if dev is not None and dev in picked:
            notes.append(
                f"{entry!r} names a device listed before it: CUDA then sees no GPU at all")
            return []
        if dev is not None and dev.mig is not None and any(p.mig for p in picked):
            notes.append(f"{entry!r} ignored: CUDA enumerates only one MIG instance per process")
            continue
        if dev is None:
            rest = [e.strip() for e in entries[pos + 1 :]]
            dropped = f"; ignored after it: {', '.join(repr(e) for e in rest)}" if rest else ""
            if why == "negative":
                if pos == 0:
                    notes.append(f"{entry!r} first: a negative index hides every GPU")
                elif rest:
                    notes.append(f"{entry!r} ends the list (negative hides the rest){dropped}")
            else:
                notes.append(f"{entry!r} {why}; CUDA stops at the first invalid entry{dropped}")
            break
        if not kind and not _INDEX.fullmatch(entry):
            notes.append(f"{entry!r} read as {_strtoul(entry)}: CUDA reads its leading digits")
        picked.append(dev)
    return picked


def _strtoul(entry: str) -> int:
    """The leading (optionally signed) integer of ``entry``, or -1 when there is none."""
    m = _INDEX.match(entry)
    return int(m.group(0)) if m else -1


def _match(entry: str, kind: str, gpus: list[PhysicalGpu]) -> tuple[VisibleDevice | None, str]:
    if not entry:
        return None, "is an empty entry"
    if not kind:
        i = _strtoul(entry)
        if i < 0:
            return (None, "negative") if _INDEX.match(entry) else (
                None, "is not a GPU index (a list that starts with an index holds only indices)")
        if i >= len(gpus):
            have = f"{len(gpus)} GPU(s), 0..{len(gpus) - 1}" if gpus else "no GPU"
            return None, f"is out of range (there are {have})"
        return VisibleDevice(gpus[i].index), ""
    if not entry.startswith(kind):
        return None, f"is not a {kind} UUID (a list that starts with one holds only those)"
    if kind == "GPU-":
        hits = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if len(hits) == 1:
            return VisibleDevice(hits[0].index), ""
        near = [g.uuid for g in gpus if g.uuid.lower().startswith(entry.lower())]
        if not hits and near:
            return None, f"matches no UUID: UUIDs are case-sensitive (did you mean {near[0]}?)"
        return None, _uuid_miss(hits, [g.uuid for g in hits])
    legacy = _LEGACY_MIG.fullmatch(entry)
    if legacy:
        parent, gi, ci = legacy.group(1), int(legacy.group(2)), int(legacy.group(3))
        for g in gpus:
            for m in g.mig:
                if g.uuid == parent and (m.gpu_instance, m.compute_instance) == (gi, ci):
                    return VisibleDevice(g.index, m), ""
        return None, "matches no MIG instance"
    mig_hits = [(g, m) for g in gpus for m in g.mig if m.uuid.startswith(entry)]
    if len(mig_hits) == 1:
        return VisibleDevice(mig_hits[0][0].index, mig_hits[0][1]), ""
    return None, _uuid_miss(mig_hits, [m.uuid for _, m in mig_hits])


def _uuid_miss(hits: Sequence[object], uuids: list[str]) -> str:
    if hits:
        return f"is ambiguous (matches {', '.join(uuids)})"
    return "matches no UUID that `nvidia-smi -L` lists"


def renumber_links(devices: Sequence[VisibleDevice], links: Sequence[Link]) -> tuple[Link, ...]:
    """The physical links between whole visible GPUs, renumbered to job ordinals (a < b), sorted.

    The one implementation: inspection and described machines both use it."""
    ordinal = {d.physical: i for i, d in enumerate(devices) if d.mig is None}
    out = [
        replace(ln, a=min(ordinal[ln.a], ordinal[ln.b]), b=max(ordinal[ln.a], ordinal[ln.b]))
        for ln in links
        if ln.a in ordinal and ln.b in ordinal
    ]
    return tuple(sorted(out, key=lambda ln: (ln.a, ln.b)))


def job_gpu(ordinal: int, dev: VisibleDevice, parent: PhysicalGpu) -> Gpu:
    """The job's GPU ``ordinal``: a whole physical GPU, or one MIG instance of it.

    The one implementation: inspection and described machines both use it."""
    mig = dev.mig
    return Gpu(
        index=ordinal,
        name=(mig.name or f"{parent.name} (MIG)") if mig else parent.name,
        compute_capability=parent.compute_capability,
        memory_bytes=mig.memory_bytes if mig else parent.memory_bytes,
        uuid=mig.uuid if mig else parent.uuid,
        pci_bus_id=parent.pci_bus_id,
        physical_index=parent.index,
        mig_enabled=mig is not None or parent.mig_enabled,
        # a MIG instance's own free memory is not read: unknown rather than the parent's
        memory_free_bytes=None if mig else parent.memory_free_bytes,
        nvlinks_outside=parent.nvlinks_outside,
    )

