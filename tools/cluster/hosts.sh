#!/usr/bin/env bash
# Several simulated hosts on one machine, for tests that run jobs across "hosts".
#
#   hosts.sh up [N=3]        create hosts h1..hN (idempotent: an existing, healthy host is kept)
#   hosts.sh exec HOST CMD...  run CMD inside HOST (its net, uts, ipc and mount namespaces),
#                              with the caller's working directory and environment
#   hosts.sh down            remove every host (holders, namespaces, links, state)
#   hosts.sh counters        one line per host: "HOST RX_BYTES TX_BYTES" of its eth0
#   hosts.sh cut HOST        take HOST's link down (its bridge-side veth); `heal HOST` brings it back
#   hosts.sh kill HOST       HOST dies: its link goes down (its peers hear nothing more from it), then every
#                            process inside it but its holder is killed (SIGKILL); `heal HOST` brings the link back
#   hosts.sh addr HOST       print HOST's address
#   hosts.sh shape HOST RATE  bound HOST's link to RATE both ways (tc's tbf: 10gbit, 1gbit; "off" removes it)
#   hosts.sh list            print the hosts that are up, one per line
#
# Each host hK is
#   * a network namespace "${PREFIX}-hK" whose eth0 (10.213.7.K/24) is one end of a veth
#     pair; the other end ("${PREFIX}-hK" in the root namespace) is a port of the bridge
#     "${PREFIX}br0", which has no address: the hosts reach each other, not the root
#     namespace nor anything else; lo is up;
#   * a holder process (sleep) with its own UTS namespace (hostname hK), IPC namespace and
#     mount namespace, in which /etc/hosts is bind-mounted from a per-host file holding
#     Debian's trap line "127.0.1.1 hK" and "10.213.7.J hJ" for the other hosts, and
#     /dev/shm is a private tmpfs (shared memory cannot cross hosts).
#
# Exit status 77 with one line on stderr when namespaces cannot be made (tests skip).
# Environment: MPIDIST_CLUSTER_PREFIX (default "mpd": names of namespaces and links),
# MPIDIST_CLUSTER_NET (default "10.213.7": the /24 used inside the namespaces only),
# MPIDIST_CLUSTER_STATE (default /run/mpidist-cluster-$PREFIX).
set -u -o pipefail

PREFIX=${MPIDIST_CLUSTER_PREFIX:-mpd}
NET=${MPIDIST_CLUSTER_NET:-10.213.7}
STATE=${MPIDIST_CLUSTER_STATE:-/run/mpidist-cluster-$PREFIX}
BRIDGE=${PREFIX}br0
T="timeout 20"  # every system command is bounded

die() { echo "hosts.sh: $*" >&2; exit 1; }
skip() { echo "hosts.sh: $*" >&2; exit 77; }

ns_of() { echo "${PREFIX}-$1"; }           # network namespace of host $1
veth_of() { echo "${PREFIX}-$1"; }         # its bridge-side veth (<= 15 characters)
num_of() { echo "${1#h}"; }

check_host_name() {
    [[ $1 =~ ^h[0-9]+$ ]] && (( ${1#h} >= 1 && ${1#h} <= 254 )) || die "not a host name: '$1' (h1..h254)"
}

start_time() {  # field 22 of /proc/PID/stat (after the parenthesised command name); fails for a dead process
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    # shellcheck disable=SC2086  # split into fields on purpose
    set -- $stat
    [[ $1 != [ZX] ]] || return 1  # a zombie keeps its entry until reaped, but not its namespaces
    echo "${20}"
}

holder_pid() {  # the holder's pid, if it is alive and is ours
    local host=$1 pid
    [[ -r $STATE/$host.pid ]] || return 1
    pid=$(<"$STATE/$host.pid")
    # the same process that started as the holder (a recycled pid has another start time); not
    # /run/netns: inside a host (its private mount namespace) later hosts' entries are not visible
    [[ $pid =~ ^[0-9]+$ && -r $STATE/$host.start && $(start_time "$pid") == $(<"$STATE/$host.start") ]] || return 1
    echo "$pid"
}

hosts_up() {  # the hosts with a state file, sorted by number
    [[ -d $STATE ]] || return 0
    local f
    for f in "$STATE"/h*.pid; do
        [[ -e $f ]] || continue
        f=${f##*/}
        echo "${f%.pid}"
    done | sort -t h -k 2 -n
}

preflight() {
    [[ $(id -u) == 0 ]] || skip "needs root (network namespaces, veth, mounts)"
    for tool in ip nsenter unshare mount timeout; do
        command -v "$tool" >/dev/null || skip "the tool '$tool' is missing"
    done
    local probe="${PREFIX}-probe$$"
    $T ip netns add "$probe" 2>/dev/null || skip "cannot create a network namespace (ip netns add failed)"
    $T ip netns del "$probe" 2>/dev/null
    if ! $T ip link show "$BRIDGE" >/dev/null 2>&1; then
        $T ip link add "$BRIDGE" type bridge 2>/dev/null \
            || skip "cannot create a bridge (ip link add type bridge failed)"
        $T ip link del "$BRIDGE" 2>/dev/null
    fi
    $T ip link add "${PREFIX}-pa$$" type veth peer name "${PREFIX}-pb$$" 2>/dev/null \
        || skip "cannot create a veth pair (ip link add type veth failed)"
    $T ip link del "${PREFIX}-pa$$" 2>/dev/null
    $T unshare --uts --ipc --mount --propagation private true 2>/dev/null \
        || skip "cannot create UTS/IPC/mount namespaces (unshare --uts --ipc --mount failed)"
}

hosts_file() {  # /etc/hosts as host $1 sees it, of $2 hosts
    local me=$1 n=$2 k
    echo "127.0.0.1 localhost"
    echo "127.0.1.1 $me"  # Debian's trap: the host's own name resolves to loopback
    for ((k = 1; k <= n; k++)); do
        [[ h$k == "$me" ]] || echo "$NET.$k h$k"
    done
    echo "::1 localhost ip6-localhost ip6-loopback"
}

make_host() {  # create host $1 of $2 (its namespace, link, holder)
    local host=$1 n=$2 k ns veth pid
    k=$(num_of "$host"); ns=$(ns_of "$host"); veth=$(veth_of "$host")
    if pid=$(holder_pid "$host"); then
        # healthy already: refresh the link's state only (the hosts file is bind-mounted by inode:
        # rewrite it in place so that the holder sees the new list)
        hosts_file "$host" "$n" >"$STATE/$host.hosts.tmp"
        cat "$STATE/$host.hosts.tmp" >"$STATE/$host.hosts.live" && rm -f "$STATE/$host.hosts.tmp"
        $T ip link set "$veth" up 2>/dev/null
        return 0
    fi
    remove_host "$host"
    hosts_file "$host" "$n" >"$STATE/$host.hosts.live"
    $T ip netns add "$ns" || die "ip netns add $ns failed"
    # a fixed MAC per host: the others' neighbour caches stay right when a host is made again
    $T ip link add "$veth" type veth peer name eth0 netns "$ns" address "$(printf '02:6d:70:64:07:%02x' "$k")" \
        || die "ip link add $veth failed"
    $T ip link set "$veth" master "$BRIDGE" || die "ip link set $veth master $BRIDGE failed"
    $T ip link set "$veth" up || die "ip link set $veth up failed"
    $T ip -n "$ns" link set lo up || die "lo up in $ns failed"
    $T ip -n "$ns" addr add "$NET.$k/24" dev eth0 || die "ip addr add in $ns failed"
    $T ip -n "$ns" link set eth0 up || die "eth0 up in $ns failed"
    # the holder: new UTS, IPC and mount namespaces inside the network namespace; it sets them up,
    # writes its pid, and sleeps (setsid + no stdio: it outlives this script and any terminal)
    rm -f "$STATE/$host.pid" "$STATE/$host.start"
    setsid ip netns exec "$ns" unshare --uts --ipc --mount --propagation private \
        sh -c '
            set -e
            hostname "$1"
            mount --bind "$2/$1.hosts.live" /etc/hosts
            mount -t tmpfs -o mode=1777,size=1g tmpfs /dev/shm
            echo $$ >"$2/$1.pid.tmp"
            mv "$2/$1.pid.tmp" "$2/$1.pid"
            exec sleep infinity
        ' holder "$host" "$STATE" </dev/null >/dev/null 2>"$STATE/$host.holder.err" 9>&- &
    local waited=0
    until [[ -s $STATE/$host.pid ]]; do
        sleep 0.1
        ((++waited < 100)) || die "the holder of $host did not start: $(head -c 300 "$STATE/$host.holder.err")"
    done
    pid=$(<"$STATE/$host.pid")
    start_time "$pid" >"$STATE/$host.start" || die "the holder of $host died: $(head -c 300 "$STATE/$host.holder.err")"
}

remove_host() {  # remove host $1's holder, namespace and link (whatever exists)
    local host=$1 pid ns veth
    ns=$(ns_of "$host"); veth=$(veth_of "$host")
    if pid=$(holder_pid "$host"); then
        kill -9 "$pid" 2>/dev/null
    fi
    if $T ip netns list 2>/dev/null | grep -q "^$ns\b"; then
        # any process still inside (a job's leftovers) is the caller's bug, but must not keep the
        # namespace alive: end them
        local p
        for p in $($T ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
        $T ip netns del "$ns" 2>/dev/null
    fi
    $T ip link del "$veth" 2>/dev/null
    rm -f "$STATE/$host.pid" "$STATE/$host.start" "$STATE/$host.hosts.live" "$STATE/$host.holder.err"
    return 0
}

cmd_up() {
    local n=${1:-3} k
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 254)) || die "up: N must be 1..254, not '$n'"
    preflight
    mkdir -p "$STATE"
    exec 9>"$STATE/.lock"
    flock -w 60 9 || die "another hosts.sh holds $STATE/.lock"
    if ! $T ip link show "$BRIDGE" >/dev/null 2>&1; then
        $T ip link add "$BRIDGE" type bridge || die "ip link add $BRIDGE type bridge failed"
    fi
    $T ip link set "$BRIDGE" up || die "ip link set $BRIDGE up failed"
    for ((k = 1; k <= n; k++)); do
        make_host "h$k" "$n"
    done
    # hosts beyond N from an earlier, larger `up` go
    local host
    for host in $(hosts_up); do
        (($(num_of "$host") > n)) && remove_host "$host"
    done
    echo "$n" >"$STATE/size"
    for ((k = 1; k <= n; k++)); do $T ip -n "$(ns_of "h$k")" neigh flush all 2>/dev/null; done
    # h1 reaches every other host: a TCP connection to a closed port is refused (reached) rather
    # than timing out (no ping here; bash's /dev/tcp cannot tell the two apart)
    for ((k = 2; k <= n; k++)); do
        $T ip netns exec "$(ns_of h1)" python3 -c '
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=3).close()
except ConnectionRefusedError:
    pass
' "$NET.$k" 2>/dev/null || die "h1 cannot reach h$k at $NET.$k (bridge forwarding blocked?)"
    done
    return 0
}

cmd_down() {
    [[ -d $STATE ]] || { $T ip link del "$BRIDGE" 2>/dev/null; return 0; }
    exec 9>"$STATE/.lock"
    flock -w 60 9 || die "another hosts.sh holds $STATE/.lock"
    local host
    for host in $(hosts_up); do remove_host "$host"; done
    # namespaces whose state file was lost
    local ns
    for ns in $($T ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}-h[0-9]*$"); do
        remove_host "${ns#"${PREFIX}"-}"
    done
    $T ip link del "$BRIDGE" 2>/dev/null
    rm -rf "$STATE"
    return 0
}

cmd_exec() {
    (($# >= 2)) || die "usage: hosts.sh exec HOST CMD..."
    local host=$1 pid
    shift
    check_host_name "$host"
    pid=$(holder_pid "$host") || die "host $host is not up (hosts.sh up)"
    exec nsenter --target "$pid" --net --uts --ipc --mount --wd="$PWD" -- "$@"
}

cmd_counters() {
    local host line
    for host in $(hosts_up); do
        # /sys/class/net inside the host's namespace is not mounted for us: ask ip for the stats
        line=$($T ip -n "$(ns_of "$host")" -s -o link show eth0 2>/dev/null) || continue
        # -o: "... RX: bytes packets ... \    N P ... \    TX: bytes ... \    N P ..."
        echo "$line" | awk -v h="$host" '{
            for (i = 1; i <= NF; i++) {
                if ($i == "RX:") rx = i; if ($i == "TX:") tx = i
            }
            # the numbers follow the header words: bytes is the first number after the "\"
            n = 0; for (i = rx; i <= NF; i++) if ($i ~ /^[0-9]+$/) { rxb = $i; break }
            for (i = tx; i <= NF; i++) if ($i ~ /^[0-9]+$/) { txb = $i; break }
            print h, rxb, txb
        }'
    done
}

cmd_cut() { check_host_name "$1"; $T ip link set "$(veth_of "$1")" down; }
cmd_heal() { check_host_name "$1"; $T ip link set "$(veth_of "$1")" up; }
cmd_kill() {  # host $1 dies: its link first (no FIN or RST reaches its peers), then its processes
    check_host_name "$1"
    local holder ns p left tries=0
    holder=$(holder_pid "$1") || die "host $1 is not up (hosts.sh up)"
    ns=$(ns_of "$1")
    $T ip link set "$(veth_of "$1")" down || die "ip link set $(veth_of "$1") down failed"
    # a process may fork while the others die (a launcher's proxy): kill until none is left
    while :; do
        left=0
        for p in $($T ip netns pids "$ns" 2>/dev/null); do
            [[ $p == "$holder" ]] && continue
            kill -9 "$p" 2>/dev/null && left=1
        done
        ((left)) || return 0
        ((++tries < 50)) || die "processes inside $1 survive SIGKILL: $($T ip netns pids "$ns" | tr '\n' ' ')"
        sleep 0.1
    done
}
cmd_addr() { check_host_name "$1"; echo "$NET.$(num_of "$1")"; }
cmd_shape() {  # HOST's link, both ways, at most RATE (tc's units: 10gbit, 1gbit); "off" removes the limit.
    # A token bucket (tbf) on the bridge-side veth (into the host) and on the host's eth0 (out of it)
    check_host_name "$1"
    local host=$1 rate=${2:?rate or off} ns
    holder_pid "$host" >/dev/null || die "host $host is not up (hosts.sh up)"
    ns=$(ns_of "$host")
    $T tc qdisc del dev "$(veth_of "$host")" root 2>/dev/null
    $T ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null
    [[ $rate == off ]] && return 0
    $T tc qdisc add dev "$(veth_of "$host")" root tbf rate "$rate" burst 256kb latency 20ms \
        && $T ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 20ms \
        || die "tc could not shape $host's link (the kernel needs sch_tbf)"
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) cmd_down ;;
    exec) shift; cmd_exec "$@" ;;
    counters) cmd_counters ;;
    cut) cmd_cut "${2:?host}" ;;
    heal) cmd_heal "${2:?host}" ;;
    kill) cmd_kill "${2:?host}" ;;
    addr) cmd_addr "${2:?host}" ;;
    shape) shift; cmd_shape "$@" ;;
    list) hosts_up ;;
    *) sed -n '2,14s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
esac
