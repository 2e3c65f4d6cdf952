#!/usr/bin/env bash
# A real single-node Slurm on this machine, for tests/cluster/test_slurm.py.
#
#   tools/cluster/slurm.sh [up]   install Debian's Slurm + munge + PMIx if missing, write a one-node
#                                 config, start munged, slurmctld and slurmd, wait until the node is idle
#   tools/cluster/slurm.sh down   stop the three daemons (by their pid files)
#   tools/cluster/slurm.sh status print sinfo
#
# Runs as root, without systemd: the daemons are started in the background, detached from the caller.
# Idempotent: a second `up` with the daemons running and the config unchanged only checks sinfo.
# Exit codes: 0 ready; 77 cannot (the reason on one line of stderr, for tests to skip with); 1 usage.
#
# The node is named after `hostname -s` and declares CPUs=8 (SlurmdParameters=config_overrides), so
# `srun -n 4` fits on a 2-core machine. No cgroups: proctrack/linuxproc, task/none. MpiDefault=none.
# Packages: slurmctld slurmd slurm-client munge libpmix2 (Debian 12: Slurm 22.05.8, PMIx 4.2.2); Debian's
# mpi_pmix plugin dlopens pmix2/lib/libpmix.so, which only libpmix-dev ships, so that link is made here.
# Logs: /var/log/slurm/{slurmctld,slurmd}.log, /var/log/munge/munged.log, /tmp/mpidist-slurm-apt.log.

set -u
set -o pipefail

ACTION="${1:-up}"
PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"
export PATH
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
LOCK=/run/mpidist-slurm.lock
PACKAGES=(slurmctld slurmd slurm-client munge libpmix2)

say() { echo "slurm.sh: $*"; }
cannot() { echo "slurm.sh: cannot set up Slurm: $*" >&2; exit 77; }

running() {  # running PIDFILE: the pid in the file is alive
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE
    local pid _
    if running "$2"; then
        pid=$(cat "$2")
        kill "$pid" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
        say "stopped $1 (pid $pid)"
    fi
    rm -f "$2"
}

down() {
    stop_pidfile slurmd "$SLURMD_PID"
    stop_pidfile slurmctld "$CTLD_PID"
    stop_pidfile munged "$MUNGE_PID"
}

have_tools() {
    command -v srun >/dev/null && command -v sinfo >/dev/null && command -v slurmctld >/dev/null \
        && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && compgen -G "/usr/lib/*/slurm*/mpi_pmix.so" >/dev/null \
        && compgen -G "/usr/lib/*/libpmix.so.2*" >/dev/null
}

install() {
    have_tools && return 0
    command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get to install it"
    say "installing ${PACKAGES[*]}"
    # No systemd here: keep the packages' postinst scripts from starting the services.
    local made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    local apt=(timeout 600 env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
               -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    local ok=""
    if "${apt[@]}" "${PACKAGES[@]}" >/tmp/mpidist-slurm-apt.log 2>&1; then
        ok=1
    else
        say "apt-get install failed; running apt-get update first"
        timeout 300 apt-get update -q >>/tmp/mpidist-slurm-apt.log 2>&1 \
            && "${apt[@]}" "${PACKAGES[@]}" >>/tmp/mpidist-slurm-apt.log 2>&1 && ok=1
    fi
    [ -n "$made_policy" ] && rm -f /usr/sbin/policy-rc.d
    [ -n "$ok" ] || cannot "apt-get install ${PACKAGES[*]} failed: $(grep -E '^E:' /tmp/mpidist-slurm-apt.log | tail -1) (log: /tmp/mpidist-slurm-apt.log)"
    have_tools || cannot "installed ${PACKAGES[*]} but srun/slurmctld/slurmd/munged/mpi_pmix are still missing"
}

link_pmix() {  # sets PMIX_LINKED=1 when it made the link
    # Debian 12's mpi_pmix plugin dlopens <libdir>/pmix2/lib/libpmix.so, the unversioned name that only
    # libpmix-dev ships (with autotools and three -dev packages): link it to libpmix2's libpmix.so.2.
    local so dir
    PMIX_LINKED=""
    for so in /usr/lib/*/pmix2/lib/libpmix.so.2; do
        [ -e "$so" ] || continue
        dir=$(dirname "$so")
        if [ ! -e "$dir/libpmix.so" ]; then
            ln -sf libpmix.so.2 "$dir/libpmix.so" && PMIX_LINKED=1 && say "linked $dir/libpmix.so -> libpmix.so.2 (for srun --mpi=pmix)"
        fi
    done
}

write_config() {  # sets CONFIG_CHANGED=1 when slurm.conf was (re)written
    local host new
    host=$(hostname -s)
    mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    new=$(cat <<EOF
# Written by mpidist's tools/cluster/slurm.sh: one node, for tests. Changes are overwritten.
ClusterName=mpidist
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MailProg=/bin/true
KillWait=5
MinJobAge=60
Waittime=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)
    CONFIG_CHANGED=""
    if [ "$(cat "$CONF" 2>/dev/null)" != "$new" ]; then
        printf '%s\n' "$new" > "$CONF"
        CONFIG_CHANGED=1
        say "wrote $CONF (node $host, CPUs=8)"
    fi


}

start_detached() {  # the daemon forks away from us; keep none of our descriptors or session
    setsid "$@" </dev/null >/dev/null 2>&1 9>&-
}

start_munge() {
    if running "$MUNGE_PID" && timeout 10 munge -n </dev/null | timeout 10 unmunge >/dev/null 2>&1; then
        return 0
    fi
    rm -f "$MUNGE_PID"
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    if id munge >/dev/null 2>&1; then
        chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
        chmod 0700 /etc/munge /var/log/munge /var/lib/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
        start_detached runuser -u munge -- munged --force
    else
        chown root:root /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
        start_detached munged --force
    fi
    local _
    for _ in $(seq 50); do
        timeout 10 munge -n </dev/null 2>/dev/null | timeout 10 unmunge >/dev/null 2>&1 && { say "started munged"; return 0; }
        sleep 0.2
    done
    cannot "munged does not start: $(tail -1 /var/log/munge/munged.log 2>/dev/null)"
}

node_state() {
    timeout 10 sinfo -h -N -n "$(hostname -s)" -o %T 2>/dev/null | head -1
}

up() {
    [ "$(id -u)" = 0 ] || cannot "needs root (runs apt-get and starts slurmctld/slurmd/munged)"
    exec 9>"$LOCK" || cannot "cannot open $LOCK"
    flock -w 120 9 || cannot "another slurm.sh has held $LOCK for 120 s"
    install
    link_pmix
    write_config
    start_munge
    if [ -n "$PMIX_LINKED" ]; then
        stop_pidfile slurmd "$SLURMD_PID"
    fi
    if [ -n "$CONFIG_CHANGED" ]; then
        stop_pidfile slurmd "$SLURMD_PID"
        stop_pidfile slurmctld "$CTLD_PID"
    fi
    if ! running "$CTLD_PID"; then
        rm -f "$CTLD_PID"
        # -i: start even if the saved state does not match this config; jobs of an earlier run are dropped.
        start_detached slurmctld -i
        local _
        for _ in $(seq 100); do timeout 5 scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
        running "$CTLD_PID" || cannot "slurmctld does not start: $(grep -iE 'error|fatal' /var/log/slurm/slurmctld.log | tail -1)"
        say "started slurmctld (pid $(cat $CTLD_PID))"
    fi
    if ! running "$SLURMD_PID"; then
        rm -f "$SLURMD_PID"
        start_detached slurmd
        local _
        for _ in $(seq 50); do running "$SLURMD_PID" && break; sleep 0.2; done
        running "$SLURMD_PID" || cannot "slurmd does not start: $(grep -iE 'error|fatal' /var/log/slurm/slurmd.log | tail -1)"
        say "started slurmd (pid $(cat $SLURMD_PID))"
    fi
    local state="" _
    for _ in $(seq 120); do
        state=$(node_state)
        case "$state" in
            idle*|mixed*|allocated*|completing*) break ;;
            down*|drain*|fail*)
                timeout 10 scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 ;;
        esac
        sleep 0.5
    done
    case "$state" in
        idle*|mixed*|allocated*|completing*) ;;
        *) cannot "node $(hostname -s) is '${state:-not listed}' after 60 s: $(timeout 10 scontrol show node "$(hostname -s)" 2>&1 | grep -o 'Reason=.*' | head -1)" ;;
    esac
    say "ready: node $(hostname -s) $state; $(timeout 10 sinfo -V 2>/dev/null); srun --mpi: $(timeout 10 srun --mpi=list 2>&1 | grep -oE 'pmix[^ ]*|pmi2|none|cray_shasta' | sort -u | tr '\n' ' ')"
}

case "$ACTION" in
    up) up ;;
    down)
        [ "$(id -u)" = 0 ] || cannot "needs root"
        down ;;
    status) timeout 10 sinfo -N -l ;;
    *) echo "usage: $0 [up|down|status]" >&2; exit 1 ;;
esac
