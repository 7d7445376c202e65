#!/usr/bin/env bash
# A real one-node SLURM on this machine, as root, without systemd.
#
#   cluster/local_slurm.sh start    # munged -> mariadbd -> slurmdbd -> slurmctld -> slurmd, wait for idle
#   cluster/local_slurm.sh status   # which daemons run, plus sinfo
#   cluster/local_slurm.sh stop     # by pid files only: TERM, then KILL after ~5 s
#   cluster/local_slurm.sh env      # print the export line clients need
#
# Multi-node (cluster/local_slurm_nodes.sh): `start --nodes N` (N >= 2) runs one network
# namespace per node (hostnames n1..nN, each its own slurmd) plus a head namespace (slurmctld,
# slurmdbd, mariadbd); `stop`, `status`, `env` find the node count in $PARALAYER_SLURM_HOME/nodes
# (or take --nodes N); `kill-node K` SIGKILLs every process of node nK (a power loss).
# Its default home is /tmp/paralayer-slurm-<N>node, so it runs beside the one-node cluster
# (own munged, own daemons in their own namespaces, own ports there): the two coexist.
#
# Everything (config, keys, state, logs, pids, DB) lives under one folder:
#   PARALAYER_SLURM_HOME (default /tmp/paralayer-slurm)
# Clients find the cluster through SLURM_CONF: `eval "$(cluster/local_slurm.sh env)"`.
#
# Other knobs (environment):
#   PARALAYER_SLURM_PARTITION   partition name            (default: debug)
#   PARALAYER_SLURM_PORT_BASE   slurmctld port; slurmd, slurmdbd use +1, +2   (default: 6817)
#   PARALAYER_SLURM_DB_PORT     private MariaDB port      (default: 3399)
#   PARALAYER_SLURM_TIMEOUT     seconds to wait for idle  (default: 60)
#   PARALAYER_SLURM_SLOTS       task slots of the node: its CPUs = max(cores, this)  (default: 8)
#   PARALAYER_SLURM_MAX_TIMEOUT requeues allowed on timeout (slurm.conf doesn't need it; informational)
#   PARALAYER_SLURM_SLURMD_TIMEOUT, PARALAYER_SLURM_MSG_TIMEOUT   multi-node only (default 6 and 5 s; see slurm.conf)
#
# Requires the Debian packages installed by cluster/install_slurm_deps.sh.
set -uo pipefail

CMD="${1:-}"; shift || true
NODES_ARG=""; NODES_GIVEN=""
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES_ARG="${2:-}"; NODES_GIVEN=1; shift; [ $# -gt 0 ] && shift ;;  # no value: no loop
        --nodes=*) NODES_ARG="${1#--nodes=}"; NODES_GIVEN=1; shift ;;
        *) KILL_NODE="$1"; shift ;;
    esac
done
# at most 3 digits before any arithmetic (a longer number is bash's integer overflow error)
if [ -n "$NODES_GIVEN" ] && ! [[ "$NODES_ARG" =~ ^[1-9][0-9]{0,2}$ ]]; then
    echo "local_slurm: --nodes '${NODES_ARG:0:40}': expected a whole number from 1 to 12" >&2; exit 2
fi
if [ -n "${PARALAYER_SLURM_HOME:-}" ]; then H="$PARALAYER_SLURM_HOME"
elif [ -n "$NODES_ARG" ] && [ "$NODES_ARG" -gt 1 ]; then H="/tmp/paralayer-slurm-${NODES_ARG}node"
else H="/tmp/paralayer-slurm"; fi
if [ -n "$NODES_ARG" ]; then NODES="$NODES_ARG"
elif [ -s "$H/nodes" ]; then NODES="$(tr -dc '0-9' < "$H/nodes")"
else NODES=1; fi
PARTITION="${PARALAYER_SLURM_PARTITION:-debug}"
PORT_BASE="${PARALAYER_SLURM_PORT_BASE:-6817}"
CTLD_PORT="$PORT_BASE"
SLURMD_PORT="$((PORT_BASE + 1))"
DBD_PORT="$((PORT_BASE + 2))"
DB_PORT="${PARALAYER_SLURM_DB_PORT:-3399}"
TIMEOUT="${PARALAYER_SLURM_TIMEOUT:-60}"
SLOTS="${PARALAYER_SLURM_SLOTS:-8}"
# a running cluster whose slurm.conf lacks this line was made by an older version: start restarts it
CONF_MARK="# paralayer-local-slurm v3: CPUs are task slots, 1 s scheduler, quick node loss"
CLUSTER_NAME="paralayer"
DB_PASS="paralayer-local-slurm"

ETC="$H/etc"
RUN="$H/run"
LOG="$H/log"
MUNGE_DIR="$H/munge"          # socket + pid + seed + log (owned by munge, 0755: clients need +x)
MUNGE_KEY_DIR="$H/munge-key"  # 0700, owned by munge
MUNGE_SOCK="$MUNGE_DIR/munge.socket"
DB_DIR="$H/mysql"
DB_RUN="$H/mysql-run"          # socket + pid + log of mariadbd (owned by mysql)
DB_SOCK="$DB_RUN/mysqld.sock"
CONF="$ETC/slurm.conf"

PID_MUNGE="$MUNGE_DIR/munged.pid"
PID_DB="$DB_RUN/mariadbd.pid"
PID_DBD="$RUN/slurmdbd.pid"
PID_CTLD="$RUN/slurmctld.pid"
PID_SLURMD="$RUN/slurmd.pid"

LOG_MUNGE="$MUNGE_DIR/munged.log"
LOG_DB="$DB_RUN/mariadbd.log"
LOG_DBD="$LOG/slurmdbd.log"
LOG_CTLD="$LOG/slurmctld.log"
LOG_SLURMD="$LOG/slurmd.log"

NODE="$(hostname -s)"
# shellcheck source=cluster/local_slurm_nodes.sh
source "$(dirname "${BASH_SOURCE[0]}")/local_slurm_nodes.sh"
HEAD=()   # the prefix that starts a head daemon (empty on one node)
CTLD_ADDR=127.0.0.1
if [ "$NODES" -gt 1 ]; then
    ns_prefix "$HEAD_NS" head; HEAD=("${NS_PREFIX[@]}")
    CTLD_ADDR="$NET.2"
    NODE="n1"
fi

say() { echo "local_slurm: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

pid_of() {  # pid_of PIDFILE -> prints the pid if that daemon is alive, returns 0; else returns 1
    # Every pid file is named after its program (slurmd.pid ...): a pid reused by another
    # process after a crash is not taken for ours (and never signalled by stop).
    local f="$1" p comm
    [ -s "$f" ] || return 1
    p="$(tr -dc '0-9' < "$f" 2>/dev/null)"
    [ -n "$p" ] || return 1
    kill -0 "$p" 2>/dev/null || return 1
    if [ -r "/proc/$p/comm" ]; then
        comm="$(cat "/proc/$p/comm" 2>/dev/null)"
        [ "$comm" = "$(basename "$f" .pid)" ] || return 1
    fi
    echo "$p"
}

alive() { pid_of "$1" >/dev/null; }

tail_log() {  # tail_log NAME FILE
    echo "----- last lines of $2 ($1) -----" >&2
    if [ -f "$2" ]; then tail -n 25 "$2" >&2; else echo "(no log file)" >&2; fi
    echo "-----" >&2
}

# wait_for DESC SECONDS PIDFILE LOGFILE CHECK_CMD... : poll CHECK_CMD until ok; fail fast if the
# daemon behind PIDFILE died (once its pid file has appeared or after a grace period).
wait_for() {
    local desc="$1" secs="$2" pidf="$3" logf="$4"; shift 4
    local deadline=$(( $(date +%s) + secs )) seen_pid=0 start; start=$(date +%s)
    while :; do
        if { [[ "$pidf" =~ ^[0-9]+$ ]] && kill -0 "$pidf" 2>/dev/null; } || alive "$pidf"; then seen_pid=1
        elif [ "$seen_pid" = 1 ] || [ $(( $(date +%s) - start )) -ge 5 ]; then
            say "$desc: daemon is not running"; tail_log "$desc" "$logf"; return 1
        fi
        if timeout 3 "$@" >/dev/null 2>&1; then return 0; fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            say "$desc: not ready after ${secs}s"; tail_log "$desc" "$logf"; return 1
        fi
        sleep 0.2
    done
}

require_bins() {
    local b missing=()
    for b in munged mungekey mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sinfo scontrol; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
    done
    [ "${#missing[@]}" -eq 0 ] || die "missing programs: ${missing[*]} (run cluster/install_slurm_deps.sh)"
    [ "$(id -u)" -eq 0 ] || die "must run as root (daemons run as root/munge/mysql users)"
}

write_configs() {
    local cpus boards sockets cores threads realmem line
    line="$(slurmd -C 2>/dev/null | head -n1)"
    cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$line")"
    boards="$(sed -n 's/.*Boards=\([0-9]*\).*/\1/p' <<<"$line")"
    sockets="$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$line")"
    cores="$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$line")"
    threads="$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$line")"
    realmem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$line")"
    [ -n "$cpus" ] || cpus="$(nproc)"
    [ -n "$realmem" ] || realmem=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 ))
    # headroom: 90% of the memory, and at least 512 MiB left over
    local mem=$(( realmem * 9 / 10 ))
    [ $(( realmem - mem )) -ge 512 ] || mem=$(( realmem - 512 ))
    [ "$mem" -ge 256 ] || mem=256
    # Task slots: a CPU development node runs one rank per task and the ranks share the cores, as
    # cluster=local's ranks do (each rank sizes its threads to cores / local ranks). Declaring only
    # the cores would refuse the default recipe's 4 ranks on a 2-core machine ("More processors
    # requested than permitted"), and sbatch --overcommit does not lift --ntasks-per-node. So the
    # node offers max(cores, PARALAYER_SLURM_SLOTS) CPUs and slurmd takes the configured count.
    local slots="$SLOTS"
    [ "$slots" -ge "$cpus" ] 2>/dev/null || slots="$cpus"
    local topo="CPUs=$slots"
    if [ "$slots" = "$cpus" ] && [ -n "$sockets" ] && [ -n "$cores" ] && [ -n "$threads" ]; then
        topo="$topo Boards=${boards:-1} SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
    fi

    local ctld_host="$NODE(127.0.0.1)" spool="$H/spool" pid_slurmd="$PID_SLURMD" log_slurmd="$LOG_SLURMD"
    local slurmd_timeout=60 msg_timeout=10 nodelines="NodeName=$NODE NodeAddr=127.0.0.1 $topo RealMemory=$mem State=UNKNOWN"
    local nodelist="$NODE" k
    if [ "$NODES" -gt 1 ]; then
        ctld_host="head($CTLD_ADDR)"; spool="$H/spool/%n"; pid_slurmd="$RUN/%n/slurmd.pid"
        log_slurmd="$LOG/slurmd-%n.log"; slurmd_timeout="${PARALAYER_SLURM_SLURMD_TIMEOUT:-6}"
        msg_timeout="${PARALAYER_SLURM_MSG_TIMEOUT:-5}"
        nodelines=""; nodelist="n[1-$NODES]"
        for k in $(seq 1 "$NODES"); do
            nodelines+="NodeName=n$k NodeAddr=$(node_addr "$k") CPUs=$slots RealMemory=$(( mem / NODES )) State=UNKNOWN"$'\n'
        done
    fi

    cat > "$CONF" <<EOF
# Generated by cluster/local_slurm.sh -- a $NODES-node SLURM for development and CI.
$CONF_MARK ($cpus cores, $slots task slots)
ClusterName=$CLUSTER_NAME
SlurmctldHost=$ctld_host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root

AuthType=auth/munge
CredType=cred/munge
# our own munge socket; cred_expire=5 so a requeued job is held PENDING (BeginTime) 6 s, not 121 (10 held it 12 s)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5

StateSaveLocation=$H/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$PID_CTLD
SlurmdPidFile=$pid_slurmd
SlurmctldLogFile=$LOG_CTLD
SlurmdLogFile=$log_slurmd
SlurmctldDebug=info
SlurmdDebug=info

# the node's CPUs are task slots (see NodeName below): slurmd takes the configured count
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a job starts within ~1 s of its submission or of its requeue hold ending (2 and 2: 0.6 s mean, 1.3 s p90)
SchedulerParameters=sched_interval=1,bf_interval=1
MailProg=/bin/true
ReturnToService=2
# reject at submission a job that can never run here (e.g. more tasks than CPUs), instead of
# leaving it PENDING (PartitionConfig) forever
EnforcePartLimits=ALL
# SIGTERM to SIGKILL: the save window of a SIGTERM at a requeue (tests/test_slurm_e2e.py). Not
# shorter: at 2 s a cancelled step ended later (7.4 s, not 4.7: its stepd then retried the task-exit
# message to an srun already gone, for MessageTimeout s)
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=$slurmd_timeout
# Multi-node: a dead node (kill-node) is DOWN after two failed pings; each ping retries the refused
# connection for MessageTimeout s (slurmctld reads it at start), pings go every SlurmdTimeout/3 s.
# SlurmdTimeout 10 with MessageTimeout 10: 26-29 s from the power loss to NODE_FAIL; 6 and 5: 16-18 s
MessageTimeout=$msg_timeout
Waittime=0

# accounting through slurmdbd: required for sacct, which submitit needs to see failed/cancelled jobs
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTLD_ADDR
AccountingStoragePort=$DBD_PORT
# without this slurmctld->slurmdbd uses /run/munge and dies ("we have no TRES from it")
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.txt

$nodelines
PartitionName=$PARTITION Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP
EOF
    chmod 644 "$CONF"

    # slurmdbd has no -f: it reads slurmdbd.conf next to \$SLURM_CONF; mode 600, owned by SlurmUser
    cat > "$ETC/slurmdbd.conf" <<EOF
# Generated by cluster/local_slurm.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$([ "$NODES" -gt 1 ] && echo head || echo localhost)
DbdAddr=$CTLD_ADDR
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$PID_DBD
LogFile=$LOG_DBD
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chown root:root "$ETC/slurmdbd.conf"
    chmod 600 "$ETC/slurmdbd.conf"
}

make_dirs() {
    mkdir -p "$H" "$ETC" "$RUN" "$LOG" "$H/state" "$H/spool" "$MUNGE_DIR" "$MUNGE_KEY_DIR" "$DB_DIR" "$DB_RUN"
    chmod 755 "$H" "$ETC" "$RUN" "$LOG"
    chown munge:munge "$MUNGE_DIR" "$MUNGE_KEY_DIR"
    chmod 755 "$MUNGE_DIR"
    chmod 700 "$MUNGE_KEY_DIR"
    chown mysql:mysql "$DB_DIR" "$DB_RUN"
    chmod 750 "$DB_DIR"
    chmod 755 "$DB_RUN"
}

start_munge() {
    if alive "$PID_MUNGE"; then say "munged already running (pid $(pid_of "$PID_MUNGE"))"; return 0; fi
    if [ ! -s "$MUNGE_KEY_DIR/munge.key" ]; then
        mungekey --create --keyfile="$MUNGE_KEY_DIR/munge.key" || die "mungekey failed"
        chown munge:munge "$MUNGE_KEY_DIR/munge.key"
        chmod 600 "$MUNGE_KEY_DIR/munge.key"
    fi
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    # munged refuses a log file it does not own
    if [ -e "$LOG_MUNGE" ] && [ "$(stat -c %U "$LOG_MUNGE")" != munge ]; then chown munge:munge "$LOG_MUNGE"; fi
    runuser -u munge -- munged --socket="$MUNGE_SOCK" --key-file="$MUNGE_KEY_DIR/munge.key" \
        --pid-file="$PID_MUNGE" --log-file="$LOG_MUNGE" --seed-file="$MUNGE_DIR/munged.seed" \
        >>"$LOG/munged.out" 2>&1 \
        || { tail_log munged "$LOG/munged.out"; tail_log munged "$LOG_MUNGE"; die "munged failed to start"; }
    wait_for munged 15 "$PID_MUNGE" "$LOG_MUNGE" \
        bash -c "munge -n --socket='$MUNGE_SOCK' | unmunge --socket='$MUNGE_SOCK'" \
        || die "munged not working"
}

db_client() { mariadb --no-defaults --protocol=socket --socket="$DB_SOCK" -u root "$@"; }

start_db() {
    if alive "$PID_DB"; then say "mariadbd already running (pid $(pid_of "$PID_DB"))"; return 0; fi
    local fresh=0
    if [ ! -d "$DB_DIR/mysql" ]; then
        fresh=1
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR" \
            --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 \
            || { tail_log mariadb-install-db "$LOG/mariadb-install.log"; die "mariadb-install-db failed"; }
    fi
    rm -f "$DB_SOCK"
    setsid nohup "${HEAD[@]}" mariadbd --no-defaults --user=mysql --datadir="$DB_DIR" \
        --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --pid-file="$PID_DB" --log-error="$LOG_DB" \
        --innodb-buffer-pool-size=64M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
        --skip-log-bin --max-connections=100 \
        </dev/null >>"$LOG/mariadbd.out" 2>&1 &
    wait_for mariadbd 30 "$!" "$LOG_DB" \
        mariadb-admin --no-defaults --protocol=socket --socket="$DB_SOCK" -u root ping \
        || die "mariadbd did not come up"
    if [ "$fresh" = 1 ] || ! db_client -N -e "SELECT 1 FROM mysql.user WHERE user='slurm'" | grep -q 1; then
        db_client -e "
            CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
            FLUSH PRIVILEGES;" || die "could not create the slurm DB user"
    fi
}

start_dbd() {
    if alive "$PID_DBD"; then say "slurmdbd already running (pid $(pid_of "$PID_DBD"))"; return 0; fi
    SLURM_CONF="$CONF" "${HEAD[@]}" env SLURM_CONF="$CONF" slurmdbd >>"$LOG_DBD" 2>&1 || { tail_log slurmdbd "$LOG_DBD"; die "slurmdbd failed to start"; }
    # ready when its port accepts connections
    wait_for slurmdbd 30 "$PID_DBD" "$LOG_DBD" \
        bash -c "exec 3<>/dev/tcp/$CTLD_ADDR/$DBD_PORT" \
        || die "slurmdbd did not come up"
}

start_ctld() {
    if alive "$PID_CTLD"; then say "slurmctld already running (pid $(pid_of "$PID_CTLD"))"; return 0; fi
    "${HEAD[@]}" env SLURM_CONF="$CONF" slurmctld -c >>"$LOG_CTLD" 2>&1 || { tail_log slurmctld "$LOG_CTLD"; die "slurmctld failed to start"; }
    wait_for slurmctld 30 "$PID_CTLD" "$LOG_CTLD" env SLURM_CONF="$CONF" scontrol ping \
        || die "slurmctld did not come up"
    # `scontrol ping` prints DOWN with rc 0 on some versions: check the text too
    local deadline=$(( $(date +%s) + 30 ))
    until SLURM_CONF="$CONF" timeout 3 scontrol ping 2>/dev/null | grep -q "is UP"; do
        alive "$PID_CTLD" || { tail_log slurmctld "$LOG_CTLD"; die "slurmctld died"; }
        [ "$(date +%s)" -lt "$deadline" ] || { tail_log slurmctld "$LOG_CTLD"; die "slurmctld not UP after 30s"; }
        sleep 0.2
    done
}

start_slurmd() {
    if [ "$NODES" -gt 1 ]; then start_node_slurmds; return; fi
    if alive "$PID_SLURMD"; then say "slurmd already running (pid $(pid_of "$PID_SLURMD"))"; return 0; fi
    SLURM_CONF="$CONF" slurmd >>"$LOG_SLURMD" 2>&1 || { tail_log slurmd "$LOG_SLURMD"; die "slurmd failed to start"; }
}

node_state() { SLURM_CONF="$CONF" timeout 5 sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1; }
slurmd_pidfiles() {  # the pid file of every node's slurmd
    if [ "$NODES" -gt 1 ]; then for k in $(seq 1 "$NODES"); do slurmd_pidfile "$k"; done
    else echo "$PID_SLURMD"; fi
}

wait_idle() {
    local n
    if [ "$NODES" -gt 1 ]; then
        for n in $(seq 1 "$NODES"); do NODE="n$n" LOG_SLURMD="$LOG/slurmd-n$n.log" PID_SLURMD="$(slurmd_pidfile "$n")" wait_idle_1; done
        NODE=n1
    else wait_idle_1; fi
}

wait_idle_1() {
    local deadline=$(( $(date +%s) + TIMEOUT )) st="" resumed=0
    while :; do
        st="$(node_state)"
        case "$st" in
            idle|mixed|allocated|completing|idle~|mixed~) return 0 ;;
            drained|draining|down|down\*|drained\*|fail*)
                if [ "$resumed" = 0 ]; then
                    SLURM_CONF="$CONF" scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        for d in slurmctld:"$PID_CTLD":"$LOG_CTLD" slurmd:"$PID_SLURMD":"$LOG_SLURMD" \
                 slurmdbd:"$PID_DBD":"$LOG_DBD"; do
            IFS=: read -r n p l <<<"$d"
            # a slurmd just restarted may not have written its pid file yet: allow it 5 s
            if [ ! -s "$p" ] && [ $(( $(date +%s) + TIMEOUT - deadline )) -lt 5 ]; then continue; fi
            alive "$p" || { tail_log "$n" "$l"; die "$n died while waiting for the node (state: ${st:-?})"; }
        done
        if [ "$(date +%s)" -ge "$deadline" ]; then
            say "node $NODE not idle after ${TIMEOUT}s (state: ${st:-?})"
            tail_log slurmctld "$LOG_CTLD"; tail_log slurmd "$LOG_SLURMD"
            SLURM_CONF="$CONF" scontrol show node "$NODE" >&2 || true
            die "node not ready"
        fi
        sleep 0.2
    done
}

all_running() {
    local f
    alive "$PID_MUNGE" && alive "$PID_DB" && alive "$PID_DBD" && alive "$PID_CTLD" || return 1
    for f in $(slurmd_pidfiles); do alive "$f" || return 1; done
}

print_env() {
    echo "export SLURM_CONF=$CONF"
}

cmd_start() {
    require_bins
    local t0; t0=$(date +%s.%N)
    if all_running && [ -f "$CONF" ] && ! grep -qF "$CONF_MARK" "$CONF"; then
        say "the running cluster's slurm.conf is from an older local_slurm.sh: restarting it"
        cmd_stop
    fi
    if all_running && [ -f "$CONF" ]; then
        wait_idle
        say "already running (node $NODE: $(node_state))"
        print_env
        return 0
    fi
    make_dirs
    echo "$NODES" > "$NODES_FILE"
    [ "$NODES" -gt 1 ] && net_up
    # rewrite the config only when no slurm daemon is using it
    if ! alive "$PID_CTLD" && ! alive "$PID_SLURMD" && ! alive "$PID_DBD"; then write_configs; fi
    start_munge
    start_db
    start_dbd
    start_ctld
    start_slurmd
    wait_idle
    local t1; t1=$(date +%s.%N)
    say "up in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s ($NODES node(s), $NODE: $(node_state), partition $PARTITION)"
    print_env
}

stop_group() {  # stop_group NAME:PIDFILE ... : TERM them together, KILL what is left after ~5 s
    local item n f p i left names=() pids=() files=()
    for item in "$@"; do
        n="${item%%:*}"; f="${item#*:}"
        if p="$(pid_of "$f")"; then
            kill -TERM "$p" 2>/dev/null || true
            names+=("$n"); pids+=("$p"); files+=("$f")
        else
            rm -f "$f"
        fi
    done
    [ "${#pids[@]}" -gt 0 ] || return 0
    for i in $(seq 1 50); do
        left=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
        [ "$left" = 1 ] || break
        sleep 0.1
    done
    for i in "${!pids[@]}"; do
        if kill -0 "${pids[$i]}" 2>/dev/null; then
            kill -KILL "${pids[$i]}" 2>/dev/null || true
            say "killed ${names[$i]} (pid ${pids[$i]}) after TERM timed out"
        else
            say "stopped ${names[$i]} (pid ${pids[$i]})"
        fi
        rm -f "${files[$i]}"
    done
    for p in "${pids[@]}"; do for i in $(seq 1 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; done
}

cmd_stop() {
    # slurmd and slurmctld first (slurmctld flushes to slurmdbd), then slurmdbd, then its DB and munge
    local f ds=()
    for f in $(slurmd_pidfiles); do ds+=("slurmd:$f"); done
    stop_group "${ds[@]}" slurmctld:"$PID_CTLD"
    stop_group slurmdbd:"$PID_DBD"
    stop_group mariadbd:"$PID_DB" munged:"$PID_MUNGE"
    net_down   # multi-node: what is left in our namespaces (by pid), the links, the namespaces
    return 0
}

cmd_status() {
    local rc=0 n f p
    local ds=() k=0
    for f in $(slurmd_pidfiles); do k=$((k + 1)); ds+=("slurmd$([ "$NODES" -gt 1 ] && echo "(n$k)"):$f"); done
    for n in munged:"$PID_MUNGE" mariadbd:"$PID_DB" slurmdbd:"$PID_DBD" slurmctld:"$PID_CTLD" "${ds[@]}"; do
        f="${n#*:}"; n="${n%%:*}"
        if p="$(pid_of "$f")"; then echo "$n: running (pid $p)"; else echo "$n: stopped"; rc=1; fi
    done
    if [ -f "$CONF" ] && alive "$PID_CTLD"; then
        SLURM_CONF="$CONF" sinfo || rc=1
    fi
    print_env
    return $rc
}

case "$CMD" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    restart) cmd_stop; cmd_start ;;
    status) cmd_status ;;
    env) print_env ;;
    kill-node) [ "$NODES" -gt 1 ] || die "kill-node: $H is a one-node cluster"; cmd_kill_node "${KILL_NODE:-}" ;;
    *) echo "usage: $0 start|stop|restart|status|env [--nodes N] | kill-node K" >&2; exit 2 ;;
esac
