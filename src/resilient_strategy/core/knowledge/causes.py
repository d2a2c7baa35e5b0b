"""The causes a failed probe or training rank can have, with the words a user can act on.

A cause is a short key (``"shared_memory"``, ``"nvls_multicast"``): the probe parser
(`probe`) and the supervisor's classifier place what a failure printed on one through the
signature table (`signatures`, ``signatures.toml``), and the remedy table
(`remedies`, ``remedies.toml``) maps each cause to the environment changes worth a probe.
Pure data: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

_ROUTING = (
    ". The likeliest cause is PCIe peer-to-peer traffic routed through the IOMMU / ACS (PCIe "
    "Access Control Services), whether or not the IOMMU was detected: disable ACS in the BIOS "
    "(or per bridge with setpci), or boot with iommu=pt (intel_iommu=on iommu=pt / amd_iommu=on "
    "iommu=pt), or disable the IOMMU; NCCL_P2P_DISABLE=1 avoids the peer path meanwhile")

#: The words for a timeout judged from the workers' progress, cut before the deadline.
HANG_WORDS = ("the probe hung (judged from its ranks' progress, cut before the deadline): a "
              "rank stuck in communicator setup or a collective, or one that never arrived "
              "while the others waited")

#: Classified causes, with the words a user can act on.
CAUSES: dict[str, str] = {
    "": "",
    "nccl_duplicate_gpu": "two ranks of the group are on the same GPU (NCCL needs a GPU of its "
    "own for each rank): give each process or node its own GPU (CUDA_VISIBLE_DEVICES, or one "
    "process per GPU with --nproc-per-node); two 'nodes' on one host sharing a GPU do this",
    "nccl_invalid_usage": "NCCL rejected its configuration (ncclInvalidUsage): an NCCL_* variable "
    "names an unknown algorithm, protocol, network or interface",
    "nccl_error": "NCCL failed (ncclSystemError / ncclInternalError / remote error)",
    "nccl_network": "NCCL could not connect its ranks over the network interface it picked (a "
    "USB or unroutable interface); on one node NCCL_SOCKET_IFNAME=lo (loopback) works",
    "oom": "the GPU ran out of memory: another process holds it, or the probe's buffers do not "
    "fit; free the GPU",
    "cuda_error": "an unhandled CUDA error inside NCCL: often P2P between these GPUs is broken, "
    "or the NCCL build has no kernels for this GPU",
    "no_kernel_image": "the framework or NCCL has no kernels for this GPU's compute capability",
    "shared_memory": "NCCL could not create its /dev/shm segment: /dev/shm is too small "
    "(Docker's 64 MB default); run with --ipc=host or --shm-size, or set NCCL_SHM_DISABLE=1",
    "timeout": "the collective hung until the probe's deadline: one rank waited forever",
    "timeout_short": "the probe's timeout ran out before its workers could start, which is not "
    "a hang",
    "crash": "a worker died from a signal",
    "wrong_result": "the all-reduce completed with a wrong value" + _ROUTING,
    "nan_result": "the all-reduce completed with NaN values" + _ROUTING,
    "zero_result": "the all-reduce completed with zeros where data was sent (peer copies that "
    "return zeros)" + _ROUTING,
    "backend_unavailable": "this build of the framework does not have the backend",
    "no_device": "the worker saw fewer devices than it needs",
    "worker_error": "the probe worker raised an error",
    "inter_node": "the collective between nodes failed (the group of one process per node "
    "spanning the job)",
    # ----- causes the signature table (signatures.toml) places -----
    "nvls_multicast": "NCCL could not bind NVLink SHARP (NVLS) multicast memory on the NVSwitch "
    "fabric: the Fabric Manager or the NVSwitches are in a bad state (restart fabric manager or "
    "the node); NCCL_NVLS_ENABLE=0 keeps NCCL on plain NVLink meanwhile",
    "rdma_error": "NCCL's InfiniBand / RoCE transport failed (a completion error, a queue pair "
    "that cannot connect, a missing HCA): check the links (ibstat), the GID index on RoCE "
    "(NCCL_IB_GID_INDEX), the HCAs NCCL picks (NCCL_IB_HCA); NCCL_IB_DISABLE=1 falls back to "
    "sockets",
    "gloo_connection": "gloo could not connect its ranks over the interface it picked (the "
    "hostname resolves to loopback or to an unroutable address): set GLOO_SOCKET_IFNAME to the "
    "interface that reaches MASTER_ADDR",
    "driver_too_old": "the driver is older than the CUDA this build was made for (error 804 "
    "'forward compatibility was attempted on non supported HW', or 'the NVIDIA driver on your "
    "system is too old'): no GPU of this process can run; update the driver to one for the "
    "build's CUDA, or install a build for the CUDA your driver supports (nvidia-smi's header "
    "names it); no NCCL variable helps",
    "gloo_interface": "GLOO_SOCKET_IFNAME names a network interface this machine does not "
    "have (or one without an address; it takes one interface name, not an IP address or NCCL's "
    "'^lo,docker' list): set it to the interface that reaches MASTER_ADDR (ip -br addr), or "
    "unset it",
    "cuda_init": "the CUDA runtime could not initialise although the driver lists GPUs (error "
    "802 'system not yet initialized': on NVSwitch systems nvidia-fabricmanager is not running "
    "or not finished; error 3 / 100: no usable device in this process); fix the host, no NCCL "
    "variable helps",
    "p2p_unsupported": "CUDA refused peer-to-peer access between these GPUs (peer access is not "
    "supported, or an IPC handle of the peer could not be opened): common in VMs, behind PCIe "
    "ACS, and on consumer cards; NCCL_P2P_LEVEL or NCCL_P2P_DISABLE=1 avoids the peer path",
    "store_libuv": "the rendezvous store asked for libuv, which this PyTorch build lacks (Windows "
    "builds of torch 2.4): USE_LIBUV=0 selects the older TCPStore",
    "budget": "not probed: the time budget for the whole decision was spent (timeout= x 4)",
    "inter_worker": "the collective between the TF_CONFIG workers failed (each worker's one "
    "process of MultiWorkerMirroredStrategy, which agree on each verdict)",
    "gloo_address_family": "gloo's ranks resolved addresses of different families (IPv4 and "
    "IPv6: 'ss1.ss_family == ss2.ss_family. 2 vs 10', 'Address family not supported'): a host "
    "with both stacks where the hostname or MASTER_ADDR resolves to one family and the "
    "interface to the other; no variable of gloo's fixes it (pytorch/gloo#399): a torch whose "
    "gloo reuses the socket it bound (pytorch/gloo#503) does, or give MASTER_ADDR as an address "
    "of one family on every node (GLOO_SOCKET_IFNAME helps only where that interface has "
    "addresses of one family)",
    "invalid_ordinal": "a rank asked for a GPU this process cannot see ('invalid device "
    "ordinal'): more processes per node than visible GPUs (--nproc-per-node against "
    "CUDA_VISIBLE_DEVICES) or a device index written into the script; start one process per "
    "visible GPU, or make more GPUs visible",
    "nccl_oom": "NCCL could not allocate its buffers on the GPU while setting up the "
    "communicator or its connections ('Cuda failure 'out of memory'', 'Failed to CUDA "
    "calloc'): another process holds the GPU's memory, or the GPU is in a bad state; not a "
    "verdict on NCCL: the GPUs are checked and the same candidate is probed once more",
    "numa_host_alloc": "NCCL's host memory pinned to a NUMA node could not be allocated "
    "(cuMem host allocations, NCCL 2.23+): NUMA nodes with memory and no CPU, or ranks whose "
    "nodes differ in what they allow; NCCL_CUMEM_HOST_ENABLE=0 keeps NCCL on its /dev/shm "
    "buffers (bind each rank to its GPU's NUMA node with numactl meanwhile)",
    "loopback_refused": "a connection to a loopback address (127.0.0.1, ::1, localhost) was "
    "refused. Between nodes, a rank advertised its loopback address (its hostname resolves to "
    "127.x): set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that reaches "
    "MASTER_ADDR. On one machine, where every rank is local, no network interface is at "
    "fault: nothing listened there any more (a rank had exited), or security software or a "
    "host firewall filters loopback or the ephemeral ports (allow the lo interface and the "
    "range in net.ipv4.ip_local_port_range), then run again",
    # The machine's state, not the backend's: never cached (see ENVIRONMENTAL_CAUSES).
    "no_space": "a disk the run writes to is full (No space left on device, often the temp "
    "directory): free space there, or point TMPDIR at a disk with room, and run again",
    "host_memory": "the host ran out of memory: the kernel's OOM killer took a process of the "
    "job (a DataLoader worker, or a rank) by SIGKILL, for the host's or the container's "
    "memory limit: use fewer DataLoader workers or a smaller prefetch_factor or batch, keep "
    "the dataset out of each worker's memory, or give the job more memory",
    "too_many_files": "the process ran out of file descriptors (Too many open files): raise the "
    "limit (ulimit -n 65536) or use fewer DataLoader workers, and run again",
    "permission": "a file or directory the run needs is not writable or readable by this user "
    "(Permission denied): fix its owner or mode (or TMPDIR), and run again",
    "gpu_fault": "the GPU itself failed (an uncorrectable ECC or NVLink error, a GPU fallen "
    "off the bus or lost, an unspecified launch failure, a kernel stopped by the display "
    "watchdog): the machine's, neither the script's nor a backend's; read nvidia-smi -q and the "
    "kernel log (dmesg | grep -i xid): a new run often recovers, a repeat needs the GPU reset "
    "or the job requeued on another machine",
    "gpu_busy": "a GPU is held by another process in compute mode Exclusive_Process (nvidia-smi's "
    "'E. Process') or is prohibited ('all CUDA-capable devices are busy or unavailable'): free "
    "that GPU, give each process a GPU of its own (CUDA_VISIBLE_DEVICES), or set the compute "
    "mode to Default (nvidia-smi -c DEFAULT, as root)",
    # The launch's, not a strategy's: the job stops with the configuration code (LAUNCH_CAUSES).
    "port_in_use": "the rendezvous port is already in use on this machine (EADDRINUSE: another "
    "job, or an older job's orphan, holds it): stop that process, or pass a free --master-port "
    "(under resilient-strategy run, leave --master-port out: a one-node run takes a free port)",
    "store_unreachable": "the rendezvous store could not be reached (a client timed out "
    "connecting to MASTER_ADDR:MASTER_PORT, or the store gave up waiting for the ranks): check "
    "that MASTER_ADDR and MASTER_PORT name the node that hosts it, that it runs, and that no "
    "firewall is in between; a stale MASTER_ADDR from an older job does this",
    "name_unresolved": "a host name of the launch does not resolve (MASTER_ADDR, the rendezvous "
    "endpoint or this node's hostname: 'Name or service not known', 'Temporary failure in name "
    "resolution'): give an address, or fix /etc/hosts or DNS for that name",
    "torch_import": "the framework cannot be imported in this environment (a shared library it "
    "loads is missing or the wrong version: an older libnccl or libcudart first on "
    "LD_LIBRARY_PATH, or two NCCL packages installed): remove that directory from "
    "LD_LIBRARY_PATH or the conflicting package (pip list | grep nvidia-nccl), so that torch "
    "loads the libraries it was built with",
    "cuda_initialized": "CUDA was initialised before the decision or before a fork (a "
    "torch.cuda call at import time, or in the parent of forked workers): CUDA cannot be "
    "re-initialised in a forked process, nor see a new CUDA_VISIBLE_DEVICES; move that call "
    "below resilient_strategy(), or use the 'spawn' start method",
    # The script's: a CUDA graph capture (torch.compile mode="reduce-overhead", torch.cuda.graph)
    # met an operation that may not be captured (see SCRIPT_CAUSES).
    "graph_capture": "a CUDA graph capture met an operation it cannot record (operation not "
    "permitted when stream is capturing: a collective, a host sync or a stream of its own "
    "inside the captured region): the script's, not the backend's; compile without CUDA graphs "
    "(torch.compile mode=\"max-autotune-no-cudagraphs\" or the default mode instead of "
    "\"reduce-overhead\"), or keep collectives and synchronising calls out of the captured "
    "region",
    # The machine's storage (see run.policy.STORAGE_CAUSES), never cached.
    "storage_error": "the storage the run reads or writes failed (an I/O error, a stale NFS "
    "file handle, a read-only file system): the machine's, not the script's nor a strategy's; "
    "check the mount, or requeue the job on another node",
    # No verdict at all: how the probe ended is unknown (see NO_VERDICT_CAUSES).
    "status_lost": "a probe worker's exit status was taken by another reaper in the deciding "
    "process (a SIGCHLD handler of the script's that waits for every child), so how the probe "
    "ended is unknown",
}


#: Causes that speak for every GPU of the process, not one backend: after a probe fails with
#: one, no candidate on these GPUs is tried (a CUDA that cannot initialise never becomes "one
#: GPU" silently).
GPU_WIDE_CAUSES = frozenset({"cuda_init", "driver_too_old"})

#: Causes that come from the state of the machine (a full disk, the descriptor limit, a file's
#: permissions), not from the candidate: they say nothing about the backend, so they are never
#: cached and never rule a candidate out beyond the run that met them.
ENVIRONMENTAL_CAUSES = frozenset({"no_space", "too_many_files", "permission", "nccl_oom",
                                  "host_memory", "storage_error", "gpu_fault", "gpu_busy",
                                  "status_lost", "port_in_use", "store_unreachable",
                                  "name_unresolved", "torch_import", "cuda_initialized"})

#: Causes that are the node's own fault, its hardware or its driver: a run that ends with 75 on
#: one of them asks for a requeue elsewhere, with this node excluded (`run/preempt.settle`;
#: never for any other cause, whose fault may follow the job or be no node's). ``gpu_fault``:
#: cluster operators drain the node on it (jade-hpc-gpu/jade-hpc-gpu.github.io#194, ECC errors
#: on one node's jobs; NVIDIA/NVSentinel's gpu-health-monitor quarantines and drains a node on
#: Xid 79 "GPU has fallen off the bus", NVIDIA/NVSentinel#966); ``cuda_init`` and
#: ``driver_too_old`` speak for every GPU of the node (`GPU_WIDE_CAUSES`: the fabric manager,
#: the driver), which another node may not share.
NODE_CAUSES = frozenset({"gpu_fault", "cuda_init", "driver_too_old"})


def node_cause(causes: Iterable[str]) -> str | None:
    """The first of ``causes`` that blames the node (`NODE_CAUSES`), None when none does."""
    return next((c for c in causes if c in NODE_CAUSES), None)


#: Causes that are the launch's, not a strategy's (a port held, a store unreachable, a name
#: that does not resolve, a library that breaks ``import torch``, CUDA initialised too early):
#: every strategy would meet them. A probe that fails with one stops the decision with a
#: `LaunchFaultError` (`deciding.decide`); a training attempt with one is a ``launch``
#: verdict (`run.verdicts`): no step-down, no cache entry, the configuration's exit code.
LAUNCH_CAUSES = frozenset({"port_in_use", "store_unreachable", "name_unresolved",
                           "torch_import", "cuda_initialized"})

#: Causes that are the script's own, placed by the signature table where the error names no
#: class of the script's (a CUDA graph capture of an operation it cannot record): a training
#: attempt with one is a ``user`` verdict naming the cause and its workaround, never a
#: step-down (`run.verdicts`, `run.policy`).
SCRIPT_CAUSES = frozenset({"graph_capture"})

#: Causes that are no verdict on the candidate at all, so never a reason to fall back to
#: another (`deciding.decide`): a probe that could not write its files (``no_space``) stops
#: the decision with a `NoSpaceError` naming the temp directory; one whose exit status was
#: lost (``status_lost``) is probed once more.
NO_VERDICT_CAUSES = frozenset({"no_space", "status_lost"})

#: Causes that are no verdict on the candidate until seen twice: the GPUs the probe ran on are
#: checked (`probing.health`), then the same candidate is probed once more
#: (`deciding.decide`); only a second failure counts.
RETRY_AFTER_CHECK_CAUSES = frozenset({"nccl_oom"})


def what_and_fix(cause: str) -> tuple[str, str]:
    """A cause's words in two parts a short line can keep apart: what happened (up to its
    first top-level ": " or "; ") and what to do (after its last one); ("", "") for a cause
    with no words, (words, "") where they name no fix apart. Pure."""
    words = " ".join(CAUSES.get(cause, "").split())
    cuts: list[tuple[int, int]] = []
    depth = 0
    for i, ch in enumerate(words):
        depth = max(0, depth + {"(": 1, ")": -1}.get(ch, 0))
        if depth == 0 and words.startswith((": ", "; "), i):
            cuts.append((i, i + 2))
    if not cuts:
        return words, ""
    return words[:cuts[0][0]], words[cuts[-1][1]:]
