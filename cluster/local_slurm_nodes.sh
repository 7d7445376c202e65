# Sourced by cluster/local_slurm.sh: the namespaces of a multi-node SLURM on this one machine.
#
#   default netns: the shell, submitit, sbatch/squeue/sacct; munged (its socket is a path)
#     veth <prefix>h0  NET.1/28 ──┐
#   netns <prefix>-head  hostname head  bridge br0 NET.2/28: mariadbd (127.0.0.1), slurmdbd, slurmctld
#   netns <prefix>-nK    hostname nK    eth0 NET.(2+K)/28 ── veth ── br0 port;  slurmd
#
# The network rule: traffic only to loopback or to these namespaces' addresses. One /28 on links
# created here, no default route and no DNS server in the namespaces, IPv6 off on every link.
# Every daemon starts as `nsenter --net=/run/netns/X unshare --uts --mount --propagation private`
# with its own hostname and a private /etc/hosts and empty /etc/resolv.conf bind-mounted over the
# real ones (never edited). `ip netns exec` is not used: it remounts /sys and slurmd dies.
#
# Knobs: PARALAYER_SLURM_NET (first three octets, default 10.213.47), PARALAYER_SLURM_NETNS
# (namespace/link prefix, default pls). One multi-node cluster per machine (one subnet).

NET="${PARALAYER_SLURM_NET:-10.213.47}"
NSP="${PARALAYER_SLURM_NETNS:-pls}"
HEAD_NS="$NSP-head"
HOST_VETH="${NSP}h0"
NODES_FILE="$H/nodes"       # written at start: the node count (stop/status read it)
NETNS_FILE="$H/netns.list"  # the namespaces and default-netns links this cluster created

node_ns() { echo "$NSP-n$1"; }
node_addr() { echo "$NET.$(( 2 + $1 ))"; }

# ns_prefix NS HOSTNAME : the command prefix (in NS_PREFIX) that runs a program in netns NS with its
# own hostname, hosts and resolv.conf; it execs all the way, so $! of `prefix... prog &` is prog
ns_prefix() {
    NS_PREFIX=(nsenter --net="/run/netns/$1" unshare --uts --mount --propagation private
        sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" /etc/resolv.conf && shift 3 && exec "$@"'
        sh "$2" "$ETC/hosts" "$ETC/resolv.conf")
}
ns_exec() { local NS_PREFIX; ns_prefix "$1" "$2"; shift 2; "${NS_PREFIX[@]}" "$@"; }

v6_off() {  # v6_off NS|"" IFACE : IPv6 off on one link (best effort: some kernels have no IPv6)
    local pre=(); [ -n "$1" ] && pre=(nsenter --net="/run/netns/$1")
    "${pre[@]}" sh -c "echo 1 > /proc/sys/net/ipv6/conf/$2/disable_ipv6" 2>/dev/null || true
}

net_up() {  # the namespaces, the bridge and the veths; idempotent
    local k ns
    [ "$NODES" -le 12 ] || die "--nodes $NODES: at most 12 nodes fit the /28 subnet"
    if ip -4 route show | grep -q "^$NET\." && ! ip link show "$HOST_VETH" >/dev/null 2>&1; then
        die "the subnet $NET.0/28 is in use on this machine (set PARALAYER_SLURM_NET)"
    fi
    printf '127.0.0.1 localhost\n%s.2 head\n' "$NET" > "$ETC/hosts"
    for k in $(seq 1 "$NODES"); do echo "$(node_addr "$k") n$k" >> "$ETC/hosts"; done
    : > "$ETC/resolv.conf"
    chmod 644 "$ETC/hosts" "$ETC/resolv.conf"
    if [ -e "/run/netns/$HEAD_NS" ]; then return 0; fi
    echo "$HEAD_NS" > "$NETNS_FILE"
    ip netns add "$HEAD_NS" || die "ip netns add $HEAD_NS failed"
    ip -n "$HEAD_NS" link set lo up
    ip -n "$HEAD_NS" link add br0 type bridge || die "no bridge link type here"
    v6_off "$HEAD_NS" br0; v6_off "$HEAD_NS" all; v6_off "$HEAD_NS" default
    ip -n "$HEAD_NS" addr add "$NET.2/28" dev br0
    ip -n "$HEAD_NS" link set br0 up
    # the submitting side (this netns) reaches the head through one veth
    ip link add "$HOST_VETH" type veth peer name hp0 netns "$HEAD_NS" || die "veth $HOST_VETH failed"
    echo "link:$HOST_VETH" >> "$NETNS_FILE"
    v6_off "" "$HOST_VETH"; v6_off "$HEAD_NS" hp0
    ip addr add "$NET.1/28" dev "$HOST_VETH"
    ip link set "$HOST_VETH" up
    ip -n "$HEAD_NS" link set hp0 master br0 up
    for k in $(seq 1 "$NODES"); do
        ns="$(node_ns "$k")"
        ip netns add "$ns" || die "ip netns add $ns failed"
        echo "$ns" >> "$NETNS_FILE"
        ip -n "$ns" link set lo up
        v6_off "$ns" all; v6_off "$ns" default
        ip -n "$HEAD_NS" link add "hp$k" type veth peer name eth0 netns "$ns" || die "veth for n$k failed"
        v6_off "$HEAD_NS" "hp$k"; v6_off "$ns" eth0
        ip -n "$HEAD_NS" link set "hp$k" master br0 up
        ip -n "$ns" addr add "$(node_addr "$k")/28" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

net_down() {  # every process left in our namespaces (by pid), then the links and namespaces
    local ns p
    [ -f "$NETNS_FILE" ] || return 0
    while read -r ns; do
        case "$ns" in
            link:*) ip link del "${ns#link:}" 2>/dev/null || true ;;
            *) if [ -e "/run/netns/$ns" ]; then
                   for p in $(ip netns pids "$ns" 2>/dev/null); do
                       kill -KILL "$p" 2>/dev/null && say "killed pid $p left in $ns"
                   done
                   sleep 0.2
                   ip netns del "$ns" 2>/dev/null || say "could not delete netns $ns"
               fi ;;
        esac
    done < <(tac "$NETNS_FILE")
    rm -f "$NETNS_FILE"
}

slurmd_pidfile() { echo "$RUN/n$1/slurmd.pid"; }

start_node_slurmds() {
    local k
    for k in $(seq 1 "$NODES"); do
        mkdir -p "$H/spool/n$k" "$RUN/n$k"
        if alive "$(slurmd_pidfile "$k")"; then continue; fi
        rm -f "$(slurmd_pidfile "$k")"  # a node killed by kill-node left its pid file behind
        ns_exec "$(node_ns "$k")" "n$k" env SLURM_CONF="$CONF" slurmd >>"$LOG/slurmd-n$k.out" 2>&1 \
            || { tail_log slurmd "$LOG/slurmd-n$k.log"; die "slurmd on n$k failed to start"; }
    done
}

# kill-node K: a power loss of node nK: SIGKILL every process in its namespace (slurmd, its
# job steps, the ranks). The namespace and its link stay; `start --nodes N` brings slurmd back.
cmd_kill_node() {
    local k="${1#n}" ns p n=0
    ns="$(node_ns "$k")"
    [ -e "/run/netns/$ns" ] || die "no node n$k (netns $ns)"
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null && n=$((n + 1)); done
    say "node n$k: SIGKILLed $n process(es)"
}
