from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy.core.values.facts import Visibility
from resilient_strategy.machine.visible import (
    MigDevice,
    PhysicalGpu,
    parse_visible_devices,
    resolve_visible_devices,
    visible_problem,
)

U = [
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "GPU-8932aaaa-0000-4000-8000-000000000001",
    "GPU-1c0e2f3a-0000-4000-8000-000000000002",
    "GPU-77e5a001-0000-4000-8000-000000000003",
]
FOUR = [PhysicalGpu(i, U[i], "NVIDIA H200") for i in range(4)]
MIGS = (
    MigDevice("MIG-aaaa1111-0000-5000-8000-000000000001", "NVIDIA A100 MIG 1g.5gb", 5 << 30, 7, 0),
    MigDevice("MIG-bbbb2222-0000-5000-8000-000000000002", "NVIDIA A100 MIG 1g.5gb", 5 << 30, 8, 0),
)
A100 = [
    PhysicalGpu(0, "GPU-a1000000-0000-4000-8000-000000000000", "NVIDIA A100", mig_enabled=True,
                mig=MIGS),
    PhysicalGpu(1, "GPU-a1000000-0000-4000-8000-000000000001", "NVIDIA A100"),
]


def phys(raw: str | None, gpus: list[PhysicalGpu] = FOUR) -> tuple[int, ...]:
    vis: Visibility = parse_visible_devices(raw, gpus, device_order="PCI_BUS_ID")
    return vis.physical


def notes(raw: str | None, gpus: list[PhysicalGpu] = FOUR) -> tuple[str, ...]:
    vis: Visibility = parse_visible_devices(raw, gpus, device_order="PCI_BUS_ID")
    return vis.notes


def test_unset_means_every_gpu_in_nvml_order() -> None:
    shuffled = [FOUR[2], FOUR[0], FOUR[3], FOUR[1]]
    vis = parse_visible_devices(None, shuffled)
    assert vis == Visibility(raw=None, physical=(0, 1, 2, 3), notes=())


def test_set_but_empty_means_none() -> None:
    assert phys("") == () and phys("  ") == ()
    assert "set but empty" in notes("")[0]


def test_minus_one_hides_everything() -> None:
    assert phys("-1") == ()
    assert "hides every GPU" in notes("-1")[0]


def test_order_and_whitespace() -> None:
    assert phys("2,0") == (2, 0)
    assert phys(" 3 , 1 ") == (3, 1)
    assert phys("+1") == (1,)


def test_negative_in_the_middle_stops_like_cuda_docs_example() -> None:
    # CUDA docs: "0,2,-1,1" -> devices 0 and 2 visible, device 1 invisible.
    assert phys("0,2,-1,1") == (0, 2)
    assert notes("0,2,-1,1") == (
        "'-1' ends the list (negative hides the rest); ignored after it: '1'",
    )


def test_out_of_range_stops_and_says_what_was_dropped() -> None:
    assert phys("1,7,2") == (1,)
    (note,) = notes("1,7,2")
    assert "'7' is out of range (there are 4 GPU(s), 0..3)" in note
    assert "ignored after it: '2'" in note


def test_a_device_named_twice_hides_every_gpu_as_cuda_does() -> None:
    assert phys("0,1,0,2") == ()
    assert "CUDA then sees no GPU at all" in notes("0,1,0,2")[0]
    assert phys(f"{U[1]},GPU-8932a") == ()  # two prefixes of one UUID: the same device


def test_indices_are_read_like_strtoul() -> None:
    assert phys("1a,2") == (1, 2)
    assert notes("1a,2") == ("'1a' read as 1: CUDA reads its leading digits",)
    assert phys("0 1") == (0,) and phys("1.0") == (1,)


def test_the_first_entry_fixes_the_kind_of_the_list() -> None:
    assert phys(f"1,{U[2]}") == (1,)
    assert "not a GPU index" in notes(f"1,{U[2]}")[0]
    assert phys(f"{U[3]},0") == (3,)
    assert "not a GPU- UUID" in notes(f"{U[3]},0")[0]


def test_uuid_and_unique_prefix() -> None:
    assert phys(U[3]) == (3,)
    assert phys("GPU-1c0e") == (2,)


def test_uuids_are_case_sensitive_and_the_note_says_so() -> None:
    assert phys("GPU-77E5A001") == ()
    assert "case-sensitive" in notes("GPU-77E5A001")[0]


def test_ambiguous_or_unknown_prefix_stops() -> None:
    assert phys(f"{U[2]},GPU-8932") == (2,)
    assert "ambiguous" in notes(f"{U[2]},GPU-8932")[0]
    assert phys("GPU-deadbeef,1") == ()
    assert "matches no UUID" in notes("GPU-deadbeef,1")[0]


def test_garbage_and_empty_entries() -> None:
    assert phys("cuda:0") == ()
    assert "not a GPU index" in notes("cuda:0")[0]
    assert phys("0,,1") == (0,)
    assert "empty entry" in notes("0,,1")[0]


def test_mig_instance_by_uuid_and_legacy_form() -> None:
    res = resolve_visible_devices(MIGS[1].uuid, A100)
    assert res.visibility.physical == (0,)
    assert res.devices[0].mig == MIGS[1]
    legacy = resolve_visible_devices(f"MIG-{A100[0].uuid}/7/0", A100)
    assert legacy.devices[0].mig == MIGS[0]
    assert resolve_visible_devices("MIG-aaaa", A100).devices[0].mig == MIGS[0]
    assert resolve_visible_devices(f"MIG-{A100[0].uuid}/9/0", A100).devices == ()


def test_only_one_mig_instance_is_enumerated() -> None:
    res = resolve_visible_devices(f"{MIGS[0].uuid},{MIGS[1].uuid},1", A100)
    assert [(d.physical, d.mig) for d in res.devices] == [(0, MIGS[0])]
    assert "only one MIG instance" in res.visibility.notes[0]
    assert "'1' is not a MIG- UUID" in res.visibility.notes[1]


def test_whole_gpu_with_mig_enabled_gets_a_note() -> None:
    vis = parse_visible_devices(None, A100, device_order="PCI_BUS_ID")
    assert vis.physical == (0, 1)
    assert len(vis.notes) == 1 and "GPU 0 has MIG enabled" in vis.notes[0]


def test_device_order_note_only_for_mixed_gpus() -> None:
    mixed = [PhysicalGpu(0, U[0], "NVIDIA RTX A4000"), PhysicalGpu(1, U[1], "NVIDIA H100")]
    assert any("CUDA_DEVICE_ORDER" in n for n in parse_visible_devices(None, mixed).notes)
    assert parse_visible_devices(None, mixed, device_order="PCI_BUS_ID").notes == ()
    assert parse_visible_devices(None, FOUR).notes == ()


def test_visible_problem() -> None:
    def problem(raw: str | None, has_gpus: bool = True) -> str | None:
        return visible_problem(parse_visible_devices(raw, FOUR), has_gpus=has_gpus)

    assert problem(None) is None and problem("") is None and problem("-1") is None
    assert problem("1,9") is None  # partial: the caller logs the note
    msg = problem("9")
    assert msg is not None and "'9' is out of range" in msg
    assert problem("GPU-nope") is not None
    assert problem("9", has_gpus=False) is None  # no driver: nothing to compare against


@settings(deadline=None)  # a busy machine must not make timing flaky
@given(st.lists(st.integers(0, 3), unique=True))
def test_distinct_valid_indices_resolve_to_themselves(indices: list[int]) -> None:
    raw = ",".join(map(str, indices))
    assert phys(raw) == tuple(indices)
    if indices:
        assert notes(raw) == ()


@settings(deadline=None)  # a busy machine must not make timing flaky
@given(st.lists(st.integers(-3, 6), min_size=1))
def test_result_is_the_prefix_before_the_first_invalid_entry_or_empty_on_a_repeat(indices: list[int]) -> None:
    expected: list[int] = []
    for i in indices:
        if i in expected:  # CUDA: a device named twice empties the whole list
            expected = []
            break
        if not 0 <= i < 4:
            break
        expected.append(i)
    assert phys(",".join(map(str, indices))) == tuple(expected)


@settings(deadline=None)  # a busy machine must not make timing flaky
@given(st.one_of(st.none(), st.text()), st.integers(0, 4))
def test_parse_never_raises_on_any_text(raw: str | None, n: int) -> None:
    vis = parse_visible_devices(raw, FOUR[:n])
    assert len(set(vis.physical)) == len(vis.physical)
    assert set(vis.physical) <= set(range(n))
    assert visible_problem(vis) is None or vis.physical == ()
