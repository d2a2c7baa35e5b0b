"""Hypothesis strategies for hardware profiles, policies and probe outcomes.

    from hypothesis import given
    from resilient_strategy.testing.strategies import machines, outcome_tables

    @given(machines(), outcome_tables())
    def test_always_trains(facts, outcomes): ...
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from ..core.values.facts import Facts
from .fakes import machine

GPU_MODELS = (
    ("NVIDIA H200", (9, 0), 141),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 80),
    ("NVIDIA RTX A6000", (8, 6), 48),
    ("NVIDIA GeForce RTX 4090", (8, 9), 24),
    ("NVIDIA GeForce RTX 5090", (12, 0), 32),
    ("Tesla V100-SXM2-16GB", (7, 0), 16),
    ("NVIDIA A30", (8, 0), 24),
    ("Tesla P100-PCIE-16GB", (6, 0), 16),
)
CAUSES = ("nccl_invalid_usage", "cuda_error", "shared_memory", "crash", "wrong_result",
          "backend_unavailable", "nccl_error", "nan_result", "zero_result", "nccl_network",
          "nccl_duplicate_gpu")
OUTCOME_KEYS = ("nccl", "nccl+*", "gloo", "hierarchical_copy", "reduction_to_one_device", "*")


@st.composite
def machines(draw: Any, max_gpus: int = 8) -> Facts:
    """Realistic machines: 0..max_gpus GPUs of one model, links, host quirks, versions."""
    n = draw(st.integers(0, max_gpus))
    name, cc, mem = draw(st.sampled_from(GPU_MODELS))
    tf = draw(st.sampled_from([None, "2.15.1", "2.17.0", "2.21.0"]))
    torch = draw(st.sampled_from([None, "2.0.1", "2.7.0", "2.11.0"])) if tf else \
        draw(st.sampled_from(["2.0.1", "2.7.0", "2.11.0"]))
    env: dict[str, str] = {}
    if n >= 2 and draw(st.booleans()):  # started by torchrun, one process per GPU
        env["WORLD_SIZE"] = str(n)
    if draw(st.booleans()):
        env[draw(st.sampled_from(["NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"]))] = \
            draw(st.sampled_from(["0", "1"]))
    return machine(
        n, name=name, cc=cc, memory_gb=mem,
        nvlink=draw(st.sampled_from([0, 0, 4, 12, 18])),
        p2p=draw(st.sampled_from(["ok", "ok", "chipset_not_supported", "unknown"])),
        shm_mb=draw(st.sampled_from([None, 64, 1024, 65536])),
        container=draw(st.sampled_from(["", "", "docker"])),
        wsl2=draw(st.booleans()),
        sagemaker=draw(st.booleans()),
        aws=draw(st.booleans()),
        iommu=draw(st.sampled_from(["unknown", "on", "off"])),
        torch=torch,
        torch_cuda=draw(st.sampled_from([None, "11.7", "12.8", "13.0"])) if torch else None,
        torch_nccl=draw(st.sampled_from([None, "2.14.3", "2.21.5", "2.28.9"])) if torch else None,
        tensorflow=tf,
        tf_cuda=draw(st.sampled_from([None, "12.2", "12.3"])) if tf else None,
        tf_archs=draw(st.sampled_from([(), ("sm_80", "compute_80"), ("sm_89", "compute_90")])),
        env=env,
    )


def outcomes() -> st.SearchStrategy[str]:
    return st.one_of(
        st.just("ok"),
        st.floats(0.5, 400).map(lambda bw: f"ok:{bw:.1f}"),
        st.just("timeout"),
        st.sampled_from(CAUSES).map(lambda c: f"error:{c}"),
    )


def outcome_tables() -> st.SearchStrategy[dict[str, str]]:
    """Probe outcomes per candidate kind, for FakeProber."""
    return st.dictionaries(st.sampled_from(OUTCOME_KEYS), outcomes(), max_size=len(OUTCOME_KEYS))


def global_batches() -> st.SearchStrategy[int | None]:
    return st.one_of(st.none(), st.integers(1, 4096))
