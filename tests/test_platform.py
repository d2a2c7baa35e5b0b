"""Platform facts from fake file trees and strings (machine/platform.py): no GPU, no network."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from pathlib import Path

import pytest

from resilient_strategy.cli import main
from resilient_strategy.core.values.facts import Platform
from resilient_strategy.machine.platform import (
    detect_platform,
    parse_hosts,
    parse_hypervisor,
    parse_nvswitch,
    parse_rdma,
)
from resilient_strategy.machine.route_lookup import local_addresses, resolve_ipv4, route_to_master


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


# ----- the route to MASTER_ADDR (machine/route_lookup.py) ----------------------------------------------
ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0
ib0\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0
"""
LOCAL = {"lo": "127.0.0.1", "eth0": "192.168.1.5", "ib0": "10.9.0.5"}


def fake_tree(tmp_path: Path) -> str:
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/route").write_text(ROUTES)
    return str(tmp_path)


def test_the_route_to_master_addr_or_the_rendezvous_endpoint(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)

    def route(env: dict[str, str]) -> str | None:
        return route_to_master(env, root, addresses=lambda: LOCAL)[0]

    assert route({"MASTER_ADDR": "10.2.0.7"}) == "ib0"  # the /8 beats the default route
    assert route({"MASTER_ADDR": "172.16.0.1"}) == "eth0"
    assert route({"MASTER_ADDR": "192.168.1.5"}) == "eth0"  # this host's own address
    assert route({"MASTER_ADDR": "127.0.0.1"}) == "lo"
    assert route({"PET_RDZV_ENDPOINT": "10.2.0.7:29400"}) == "ib0"  # torchrun's endpoint
    assert route({"PET_RDZV_ENDPOINT": "[10.2.0.7]:29400"}) == "ib0"
    assert route({}) is None
    named = route_to_master({"MASTER_ADDR": "node0"}, root, addresses=lambda: LOCAL,
                            resolve=lambda host: ("10.2.0.8", ""))
    assert named[0] == "ib0" and "10.2.0.8" in named[1]
    unresolved = route_to_master({"MASTER_ADDR": "node0"}, root, addresses=lambda: LOCAL,
                                 resolve=lambda host: (None, "no such host"))
    assert unresolved == (None, "no such host")


def test_detect_platform_has_the_route_only_where_master_addr_is_set(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)
    assert (detect_platform({}, root).master_ifname, detect_platform({}, root).master_route) == (
        "", "")
    assert detect_platform({"MASTER_ADDR": "172.16.0.1"}, root).master_ifname == "eth0"
    lo = detect_platform({"MASTER_ADDR": "127.0.0.1"}, root).master_ifname
    assert lo and ipaddress.ip_address(local_addresses().get(lo, "127.0.0.1")).is_loopback


def test_a_host_name_that_does_not_resolve_in_time_leaves_the_route_unknown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hang(*args: object, **kwargs: object) -> object:
        release.wait(10)
        raise OSError("released")

    monkeypatch.setattr(socket, "getaddrinfo", hang)
    try:
        assert resolve_ipv4("node0", deadline_s=0.05)[0] is None
    finally:
        release.set()
    assert resolve_ipv4("10.0.0.1", deadline_s=0.0) == ("10.0.0.1", "")  # no lookup for an address


def test_the_route_is_shown_by_doctor_json_under_simulate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    described = tmp_path / "node.json"
    described.write_text(json.dumps({"machine": {
        "gpus": 2, "env": {"MASTER_ADDR": "10.0.0.1"},
        "platform_facts": {"master_ifname": "bond0", "master_route": "kernel route 10.0.0.0/8"}}}))
    assert main(["doctor", "--json", "--simulate", str(described)]) == 0
    platform = json.loads(capsys.readouterr().out)["facts"]["platform"]
    assert (platform["master_ifname"], platform["master_route"]) == (
        "bond0", "kernel route 10.0.0.0/8")


def test_doctor_shows_the_route_on_this_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RESILIENT_STRATEGY_CACHE_DIR", str(tmp_path))
    assert main(["doctor", "--json", "--framework", "torch"]) == 0
    platform = json.loads(capsys.readouterr().out)["facts"]["platform"]
    iface = platform["master_ifname"]
    assert iface and ipaddress.ip_address(local_addresses().get(iface, "127.0.0.1")).is_loopback
    assert platform["master_route"]


def test_the_fabric_managers_version_comes_from_dpkgs_status() -> None:
    from resilient_strategy.machine.platform import parse_fabric_manager

    status = ["Package: libc6", "Status: install ok installed", "Version: 2.35-0ubuntu3", "",
              "Package: nvidia-fabricmanager-535", "Status: install ok installed",
              "Priority: optional", "Version: 535.183.01-1", "Architecture: amd64", "",
              "Package: zlib1g", "Status: install ok installed", "Version: 1:1.2.11"]
    assert parse_fabric_manager(status) == "535.183.01"
    removed = ["Package: nvidia-fabricmanager-535", "Status: deinstall ok config-files",
               "Version: 535.183.01-1"]
    assert parse_fabric_manager(removed) == ""
    assert parse_fabric_manager(["Package: libc6", "Status: install ok installed"]) == ""
    assert parse_fabric_manager(None) == ""  # no dpkg (RPM systems): unknown
