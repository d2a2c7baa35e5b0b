"""Platform facts from fake file trees and strings (machine/platform.py): no GPU, no network."""

from __future__ import annotations

from pathlib import Path

from resilient_strategy.core.facts import Platform
from resilient_strategy.machine.platform import (
    detect_platform,
    parse_hosts,
    parse_hypervisor,
    parse_nvswitch,
    parse_rdma,
)


def test_nvswitch_present_absent_or_unknown() -> None:
    assert parse_nvswitch(["0000:05:00.0", "0000:06:00.0"], True) is True
    assert parse_nvswitch([], True) is False
    assert parse_nvswitch(None, False) is None


def test_hypervisor_from_cpu_flags_and_dmi() -> None:
    flags = "flags\t\t: fpu vme sse2 hypervisor lahf_lm\n"
    assert parse_hypervisor(flags, ["QEMU", "Standard PC (Q35 + ICH9, 2009)"], None) == "kvm"
    assert parse_hypervisor(flags, ["VMware, Inc.", None], None) == "vmware"
    assert parse_hypervisor(flags, [None, None], None) == "other"
    assert parse_hypervisor("flags\t\t: fpu vme sse2\n", ["Dell Inc.", "PowerEdge"], None) == ""
    assert parse_hypervisor(None, [None], "xen\n") == "xen"


def test_rdma_link_layer_and_active_devices() -> None:
    roce = {"mlx5_0": [("Ethernet\n", "4: ACTIVE\n")], "mlx5_1": [("Ethernet\n", "1: DOWN\n")]}
    assert parse_rdma(roce) == ("ethernet", ("mlx5_0",))
    ib = {"mlx5_0": [("InfiniBand\n", "4: ACTIVE\n")], "mlx5_2": [("Ethernet\n", "4: ACTIVE\n")]}
    assert parse_rdma(ib) == ("infiniband", ("mlx5_0", "mlx5_2"))
    assert parse_rdma({}) == ("", ())


def test_hostname_on_loopback_from_etc_hosts() -> None:
    debian = "127.0.0.1 localhost\n127.0.1.1 node7.cluster node7\n"
    assert parse_hosts(debian, "node7") is True
    assert parse_hosts("127.0.0.1 localhost\n10.0.0.7 node7  # eth0\n", "node7.cluster") is False
    assert parse_hosts("127.0.0.1 localhost\n", "node7") is None
    assert parse_hosts(None, "node7") is None


def test_detect_platform_reads_a_fake_tree(tmp_path: Path) -> None:
    (tmp_path / "proc/driver/nvidia-nvswitch/devices/0000:05:00.0").mkdir(parents=True)
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    port.mkdir(parents=True)
    (port / "link_layer").write_text("Ethernet\n")
    (port / "state").write_text("4: ACTIVE\n")
    got = detect_platform({}, str(tmp_path))
    assert (got.nvswitch, got.rdma_link_layer, got.rdma_devices) == (True, "ethernet", ("mlx5_0",))
    assert detect_platform({}, str(tmp_path / "empty")) == Platform()
