from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.core.values.facts import Host
from resilient_strategy.machine import host

CGROUP_V1_DOCKER = "12:cpu,cpuacct:/docker/4f1a2b\n1:name=systemd:/docker/4f1a2b\n"
CGROUP_K8S = "11:memory:/kubepods/burstable/pod1234/abcd\n"
MOUNTINFO_DOCKER = (
    "600 590 0:52 / / rw,relatime - overlay overlay rw\n"
    "611 600 259:1 /var/lib/docker/containers/4f1a2b/hostname /etc/hostname rw - ext4 /dev/x rw\n"
)
MOUNTINFO_HOST_RUNNING_DOCKER = (
    "29 1 259:1 / / rw,relatime - ext4 /dev/nvme0n1p1 rw\n"
    "700 29 0:60 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw\n"
)


@pytest.mark.parametrize(
    ("text", "runtime"),
    [
        (CGROUP_V1_DOCKER, "docker"),
        (CGROUP_K8S, "kubernetes"),
        ("5:cpu:/machine.slice/libpod-abc.scope\n", "podman"),
        ("0::/\n", ""),
        ("3:cpu:/user.slice\n", ""),
    ],
)
def test_parse_cgroup(text: str, runtime: str) -> None:
    assert host.parse_cgroup(text) == runtime


def test_parse_mountinfo_only_trusts_the_runtime_bind_mounts() -> None:
    assert host.parse_mountinfo(MOUNTINFO_DOCKER) == "docker"
    assert host.parse_mountinfo(MOUNTINFO_HOST_RUNNING_DOCKER) == ""
    k8s = "9 1 0:1 /var/lib/kubelet/pods/x/etc-hosts /etc/hosts rw - ext4 /dev/x rw\n"
    assert host.parse_mountinfo(k8s) == "kubernetes"


def test_parse_container_precedence() -> None:
    def run(env: dict[str, str] | None = None, **kw: Any) -> str:
        args: dict[str, Any] = {
            "dockerenv": False, "containerenv": False, "cgroup": None, "mountinfo": None, **kw
        }
        return host.parse_container(env or {}, **args)

    assert run() == ""
    assert run({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, dockerenv=True) == "kubernetes"
    assert run(cgroup=CGROUP_K8S, dockerenv=True) == "kubernetes"
    assert run(dockerenv=True) == "docker"
    assert run(containerenv=True) == "podman"
    assert run(mountinfo=MOUNTINFO_DOCKER) == "docker"
    assert run(cgroup="4:cpu:/containerd/x\n") == "containerd"


@pytest.mark.parametrize(
    ("release", "wsl"),
    [
        ("5.15.153.1-microsoft-standard-WSL2\n", True),
        ("4.4.0-19041-Microsoft", True),
        ("6.8.0-45-generic", False),
        (None, False),
    ],
)
def test_parse_wsl(release: str | None, wsl: bool) -> None:
    assert host.parse_wsl(release) is wsl


def test_parse_sagemaker_env_aws_and_efa() -> None:
    assert host.parse_sagemaker_env({"SM_CURRENT_HOST": "algo-1"})
    assert host.parse_sagemaker_env({"SAGEMAKER_REGION": "us-east-1"})
    assert not host.parse_sagemaker_env({"SMTP_HOST": "x", "HOME": "/root"})
    assert host.parse_aws_vendor("Amazon EC2\n") and not host.parse_aws_vendor("QEMU")
    assert host.parse_aws_vendor(None) is False
    assert host.parse_efa(["rdmap0s6"]) and host.parse_efa(["efa_0"])
    assert not host.parse_efa(["mlx5_0"]) and not host.parse_efa([])


@pytest.mark.parametrize(
    ("devices", "cmdline", "state"),
    [
        (["dmar0", "dmar1"], "BOOT_IMAGE=/vmlinuz ro quiet", "on"),
        (["dmar0"], "ro intel_iommu=on iommu=pt", "off"),  # passthrough: no DMA remapping
        ([], "ro amd_iommu=on", "on"),
        ([], "ro quiet", "off"),
        (None, "ro intel_iommu=off", "off"),
        (None, None, "unknown"),
        (["ivhd0"], None, "on"),
    ],
)
def test_parse_iommu(devices: list[str] | None, cmdline: str | None, state: str) -> None:
    assert host.parse_iommu(devices, cmdline) == state


@pytest.mark.parametrize(
    ("devices", "cmdline", "types", "state"),
    [
        # an IOMMU is present, but every group is passthrough (AMD's ivhd with the kernel's default)
        (["ivhd0"], "ro quiet", ["identity", "identity"], "off"),
        (["dmar0"], "ro intel_iommu=on", ["DMA", "identity"], "on"),
        (["dmar0"], "ro quiet", ["DMA-FQ"], "on"),
        # the groups are the truth, whatever the command line asked for
        (["dmar0"], "ro iommu=pt", ["DMA-FQ"], "on"),
        (["dmar0"], "ro intel_iommu=on", ["identity\n"], "off"),
        # VFIO-owned groups say nothing about the host's GPUs: fall back to the older signals
        (["dmar0"], "ro quiet", ["unmanaged"], "on"),
        ([], "ro quiet", ["blocked"], "off"),
        (None, None, [], "unknown"),
    ],
)
def test_parse_iommu_reads_the_group_types_first(
    devices: list[str] | None, cmdline: str | None, types: list[str], state: str
) -> None:
    assert host.parse_iommu(devices, cmdline, types) == state


def test_detect_host_reads_iommu_group_types(tmp_path: Path) -> None:
    passthrough = tmp_path / "pt"
    _tree(passthrough, {
        "proc/cmdline": "ro quiet\n",
        "sys/class/iommu/ivhd0/": "",
        "sys/kernel/iommu_groups/0/type": "identity\n",
        "sys/kernel/iommu_groups/1/type": "identity\n",
        "sys/kernel/iommu_groups/2/devices/": "",  # no type file (older kernel): ignored
    })
    assert host.detect_host({}, str(passthrough)).iommu == "off"
    translated = tmp_path / "dma"
    _tree(translated, {
        "proc/cmdline": "ro iommu=pt\n",  # groups switched to DMA at run time win
        "sys/class/iommu/dmar0/": "",
        "sys/kernel/iommu_groups/0/type": "identity\n",
        "sys/kernel/iommu_groups/7/type": "DMA-FQ\n",
    })
    assert host.detect_host({}, str(translated)).iommu == "on"
    no_types = tmp_path / "old"
    _tree(no_types, {"proc/cmdline": "ro quiet\n", "sys/class/iommu/dmar0/": "",
                     "sys/kernel/iommu_groups/0/devices/": ""})
    assert host.detect_host({}, str(no_types)).iommu == "on"


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("/"):
            path.mkdir(exist_ok=True)
        else:
            path.write_text(text)


def test_detect_host_on_a_fake_sagemaker_tree(tmp_path: Path) -> None:
    _tree(tmp_path, {
        ".dockerenv": "",
        "proc/1/cgroup": "0::/\n",
        "proc/sys/kernel/osrelease": "5.10.225-213.878.amzn2.x86_64\n",
        "proc/cmdline": "ro console=ttyS0\n",
        "opt/ml/input/config/resourceconfig.json": "{}",
        "sys/devices/virtual/dmi/id/sys_vendor": "Amazon EC2\n",
        "sys/class/infiniband/rdmap0s6/": "",
        "sys/class/iommu/": "",
        "dev/shm/": "",
    })
    h = host.detect_host({}, str(tmp_path))
    assert h.container == "docker"
    assert h.sagemaker and h.aws and h.efa and h.infiniband and not h.wsl2
    assert h.iommu == "off"
    assert h.kernel == "5.10.225-213.878.amzn2.x86_64"
    assert h.shm_bytes is not None and h.shm_bytes > 0
    assert h.cpu_count >= 1


def test_detect_host_on_an_empty_tree_is_all_unknown(tmp_path: Path) -> None:
    h = host.detect_host({}, str(tmp_path))
    assert h == Host(cpu_count=h.cpu_count, platform=h.platform, machine=h.machine)
    assert h.shm_bytes is None and h.iommu == "unknown"


def test_detect_host_takes_env_not_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert host.detect_host({}, str(tmp_path)).container == ""
    assert host.detect_host({"KUBERNETES_SERVICE_HOST": "x"}, str(tmp_path)).container == (
        "kubernetes"
    )


def test_detect_host_on_this_machine_does_not_raise() -> None:
    h = host.detect_host({})
    assert h.iommu in ("on", "off", "unknown")
    assert h.cpu_count >= 1
