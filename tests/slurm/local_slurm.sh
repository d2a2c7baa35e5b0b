#!/usr/bin/env bash
# A one-host SLURM for tests (from the project's tools/local_slurm.sh): `local_slurm.sh start DIR`
# installs Debian's slurm-wlm and munge where they are missing (as root), and starts munged
# (unless one runs), slurmctld and slurmd with 4 GPU GRES entries backed by placeholder device
# files under DIR; it prints `export SLURM_CONF=DIR/slurm.conf`. `local_slurm.sh stop DIR` stops
# exactly the daemons it started (their pid files under DIR). srun/sbatch/scontrol then work
# against it; CUDA_VISIBLE_DEVICES per task follows --gpus-per-task / --gres as SLURM sets it.
# SLURMCTLD_PORT / SLURMD_PORT (default 6817 / 6818) let a second one run beside another.
# Two FUTURE nodes, ghost1 and ghost2, exist only as names (never scheduled): a job may
# --exclude them, as a user excludes nodes of a larger cluster.
# The placeholders are not GPUs: inspection on a machine without GPUs still sees none, so pair it
# with the testing kit's described GPUs when a test needs the GPUs themselves.
set -euo pipefail
cmd=${1:?start|stop}; d=${2:?directory}
if [[ $cmd == stop ]]; then
  for f in "$d"/slurmd.pid "$d"/slurmctld.pid "$d"/munged.pid; do
    [[ -s $f ]] && kill "$(cat "$f")" 2>/dev/null || true
  done
  exit 0
fi
command -v slurmctld >/dev/null || { timeout 300 apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq slurm-wlm munge >/dev/null; }
mkdir -p "$d"/{state,spool,log} /run/munge; chown munge:munge /run/munge
[[ -f /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
if ! pgrep -x munged >/dev/null; then runuser -u munge -- /usr/sbin/munged --force; sleep 0.5; pgrep -n -x munged > "$d/munged.pid"; fi
for i in 0 1 2 3; do [[ -e $d/gpu$i ]] || mknod "$d/gpu$i" c 1 3; done
h=$(hostname -s)
cat > "$d/slurm.conf" <<C
ClusterName=local
SlurmctldHost=$h
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
SlurmUser=root
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/log/ctld.log
SlurmdLogFile=$d/log/d.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
GresTypes=gpu
ReturnToService=2
NodeName=$h CPUs=$(nproc) RealMemory=8000 Gres=gpu:4 State=UNKNOWN
NodeName=ghost[1-2] CPUs=1 RealMemory=100 State=FUTURE
PartitionName=p Nodes=$h Default=YES MaxTime=INFINITE State=UP
C
echo "NodeName=$h Name=gpu File=$d/gpu[0-3]" > "$d/gres.conf"
SLURM_CONF=$d/slurm.conf /usr/sbin/slurmctld -f "$d/slurm.conf"
SLURM_CONF=$d/slurm.conf /usr/sbin/slurmd -f "$d/slurm.conf"
for _ in $(seq 30); do SLURM_CONF=$d/slurm.conf sinfo -h 2>/dev/null | grep -q idle && break; sleep 1; done
echo "export SLURM_CONF=$d/slurm.conf"
