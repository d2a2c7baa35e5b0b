"""Lightning and Accelerate from a sharded Selection (issue 24.5): the keyword arguments for a
simulated machine where the selection shards (no GPU needed to build them)."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from typing import Any

import pytest

from resilient_strategy.testing import machine, simulate

TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="lightning is not installed")
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="accelerate is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.torch]


def _sharded(outcomes: dict[str, str]) -> Any:
    facts = machine(2)
    sel = simulate(facts, outcomes, framework="torch", global_batch_size=256,
                   env={**facts.env_map, **TORCHRUN_ENV}, sharding="full",
                   process_group_timeout=120)
    assert sel.sharded
    return sel


class Block:
    pass


@needs_lightning
def test_lightning_gets_fsdp_or_model_parallel_with_the_proven_backend() -> None:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from resilient_strategy.integrations.lightning import trainer_kwargs

    sel = _sharded({"nccl": "error:nccl_error", "nccl+*": "error:nccl_error", "gloo": "ok"})
    kw = trainer_kwargs(sel, shard_modules=[Block])
    assert isinstance(kw["strategy"], FSDPStrategy)
    assert kw["strategy"]._process_group_backend == "gloo"
    assert kw["strategy"]._timeout == timedelta(seconds=120)
    assert (kw["devices"], kw["num_nodes"]) == (2, 1)
    mp = trainer_kwargs(_sharded({"nccl": "ok"}), model_parallel=True)["strategy"]
    assert isinstance(mp, ModelParallelStrategy)
    assert mp._process_group_backend == "nccl"


@needs_accelerate
def test_accelerate_gets_an_fsdp2_plugin_when_the_selection_shards() -> None:
    from resilient_strategy.integrations.accelerate import accelerator_kwargs

    kw = accelerator_kwargs(_sharded({"nccl": "ok"}), shard_modules=[Block])
    plugin = kw["fsdp_plugin"]
    assert plugin.fsdp_version == 2
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    assert kw["kwargs_handlers"][0].backend == "nccl"


def _offloaded(n: int) -> Any:
    from resilient_strategy.testing.simulation import gpu

    facts = machine([gpu(i, "NVIDIA RTX A5000", (8, 6), 24, free_gb=12) for i in range(n)],
                    host_memory_gb=64)
    env = {**facts.env_map, **(TORCHRUN_ENV if n > 1 else {})}
    sel = simulate(facts, {"*": "ok"}, framework="torch", global_batch_size=32, env=env,
                   param_bytes=6 * 2**30, offload="auto")
    assert sel.offload and sel.num_replicas == n
    return sel


@needs_lightning
@needs_accelerate
def test_the_tools_offload_with_the_selection_and_refuse_one_process_offload() -> None:
    from resilient_strategy.errors import InvalidOptionError
    from resilient_strategy.integrations.accelerate import accelerator_kwargs
    from resilient_strategy.integrations.lightning import trainer_kwargs

    sel = _offloaded(2)
    assert trainer_kwargs(sel)["strategy"].cpu_offload.offload_params
    assert accelerator_kwargs(sel)["fsdp_plugin"].cpu_offload
    one = _offloaded(1)
    for tool in (trainer_kwargs, accelerator_kwargs):
        with pytest.raises(InvalidOptionError) as err:
            tool(one)
        assert err.value.option == "offload"
