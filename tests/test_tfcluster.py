"""TF_CONFIG as TensorFlow's MultiWorkerMirroredStrategy reads it (tfcluster.py): pure, from
strings; malformed ones are an InvalidOptionError naming TF_CONFIG, never a traceback."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy.core.values.tfcluster import MAX_TF_CONFIG_BYTES, TfCluster, parse_tf_config
from resilient_strategy.errors import InvalidOptionError


def cfg(cluster: Any, task: Any = None, **extra: Any) -> str:
    data: dict[str, Any] = {"cluster": cluster, **extra}
    if task is not None:
        data["task"] = task
    return json.dumps(data)


TWO = {"worker": ["a:1", "b:1"]}


@pytest.mark.parametrize("text", [None, "", "   ", "{}", '{"cluster": {}}'])
def test_no_cluster_is_not_a_cluster(text: str | None) -> None:
    assert parse_tf_config(text) is None


def test_two_workers() -> None:
    c = parse_tf_config(cfg(TWO, {"type": "worker", "index": 1}))
    assert c == TfCluster(("a:1", "b:1"), "worker", 1)
    assert (c.num_workers, c.worker_rank, c.multi_worker, c.task, c.address) == (
        2, 1, True, "worker:1", "b:1")


def test_the_chief_comes_first_and_counts_as_a_worker() -> None:
    cluster = {"chief": ["c:1"], "worker": ["a:1", "b:1"]}
    chief = parse_tf_config(cfg(cluster, {"type": "chief", "index": 0}))
    worker = parse_tf_config(cfg(cluster, {"type": "worker", "index": 1}))
    assert chief is not None and worker is not None
    assert chief.workers == worker.workers == ("c:1", "a:1", "b:1")
    assert (chief.worker_rank, worker.worker_rank, worker.num_workers) == (0, 2, 3)
    assert worker.address == "b:1"


def test_one_worker_and_an_evaluator_are_not_multi_worker() -> None:
    one = parse_tf_config(cfg({"worker": ["a:1"]}, {"type": "worker", "index": 0}))
    ev = parse_tf_config(cfg({**TWO, "evaluator": ["e:1"]}, {"type": "evaluator", "index": 0}))
    assert one is not None and not one.multi_worker
    assert ev is not None and not ev.multi_worker and ev.worker_rank is None
    assert ev.address == "e:1"


def test_dense_object_form_and_a_numeric_string_index() -> None:
    c = parse_tf_config(cfg({"worker": {"1": "b:1", "0": "a:1"}}, {"type": "worker",
                                                                  "index": "1"}))
    assert c is not None and c.workers == ("a:1", "b:1") and c.worker_rank == 1


@pytest.mark.parametrize(("text", "words"), [
    ("{not json", "not a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    (cfg([1, 2]), "cluster: expected an object"),
    (cfg({"boss": ["a:1"]}, {"type": "worker", "index": 0}), "unknown job"),
    (cfg({**TWO, "ps": ["p:1"]}, {"type": "worker", "index": 0}), "ParameterServerStrategy"),
    (cfg({**TWO, "chief": ["c:1", "d:1"]}, {"type": "worker", "index": 0}), "at most one"),
    (cfg(TWO), "task: expected"),
    (cfg(TWO, {"type": "ps", "index": 0}), "task.type"),
    (cfg(TWO, {"type": "worker", "index": 2}), "not in the cluster"),
    (cfg(TWO, {"type": "worker", "index": -1}), "task.index"),
    (cfg(TWO, {"type": "worker", "index": True}), "task.index"),
    (cfg({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}), "twice"),
    (cfg({"worker": ["a:1", 7]}, {"type": "worker", "index": 0}), "address"),
    (cfg({"worker": {"0": "a:1", "2": "b:1"}}, {"type": "worker", "index": 0}), "gaps"),
    (cfg({"worker": "a:1"}, {"type": "worker", "index": 0}), "expected a list"),
    ("[" * 100 + "]" * 100, "nested deeper"),
    (" " * (MAX_TF_CONFIG_BYTES + 1) + "{}", "more than"),
])
def test_malformed_is_an_error_naming_tf_config(text: str, words: str) -> None:
    with pytest.raises(InvalidOptionError) as err:
        parse_tf_config(text)
    assert err.value.option == "TF_CONFIG" and "TF_CONFIG" in str(err.value)
    assert words in str(err.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["cluster", "task", "worker", "chief", "ps", "evaluator", "type", "index", "0", "1"]),
        inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_is_a_cluster_none_or_a_clean_error(value: Any) -> None:
    try:
        c = parse_tf_config(json.dumps(value))
    except InvalidOptionError as exc:
        assert exc.option == "TF_CONFIG"
        return
    if c is not None:
        assert c.task_type in ("chief", "worker", "evaluator")
        assert c.worker_rank is None or 0 <= c.worker_rank < c.num_workers


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_cluster_none_or_a_clean_error(text: str) -> None:
    try:
        parse_tf_config(text)
    except InvalidOptionError as exc:
        assert exc.option == "TF_CONFIG"
