#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine (munge + slurmctld + slurmd), for tests and for
# trying the submit scripts without a cluster:
#   scripts/slurm/local_cluster.sh install        # apt-get install slurm-wlm munge (root; Debian/Ubuntu)
#   scripts/slurm/local_cluster.sh start [DIR]    # config, state and logs under DIR (default /tmp/kiln-slurm)
#   scripts/slurm/local_cluster.sh stop  [DIR]
# After start, use the printed SLURM_CONF: `SLURM_CONF=DIR/slurm.conf sbatch ...`.
set -euo pipefail
cmd=${1:-}
dir=${2:-/tmp/kiln-slurm}

case "$cmd" in
install)
    command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null && exit 0
    [[ $(id -u) == 0 ]] || { echo "local_cluster: installing slurm-wlm needs root" >&2; exit 1; }
    command -v apt-get >/dev/null || { echo "local_cluster: no apt-get on this machine" >&2; exit 1; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    ;;
start)
    [[ $(id -u) == 0 ]] || { echo "local_cluster: slurmd must run as root" >&2; exit 1; }
    for bin in munged slurmctld slurmd sbatch; do
        command -v "$bin" >/dev/null || { echo "local_cluster: $bin not found (run: $0 install)" >&2; exit 1; }
    done
    "$0" stop "$dir" >/dev/null 2>&1 || true
    mkdir -p "$dir"/{state,spool,log,munge}
    node=$(hostname -s)
    # CPUs/RealMemory as slurmd detects them: the node must not claim more than it has.
    hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ UpTime.*//')
    cat >"$dir/slurm.conf" <<EOF
ClusterName=kiln
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
KillWait=30
MinJobAge=600
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
MpiDefault=none
NodeName=$node $hw State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    munged --force --socket=/run/munge/munge.socket.2 --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" -f
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    for _ in $(seq 60); do
        sinfo -h -o %T 2>/dev/null | grep -qE '^idle' && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
        sleep 0.5
    done
    echo "local_cluster: the node did not come up; see $dir/log" >&2
    sinfo >&2 || true
    exit 1
    ;;
stop)
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [[ -f $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 1
    ;;
*)
    echo "usage: $0 install | start [DIR] | stop [DIR]" >&2
    exit 2
    ;;
esac
