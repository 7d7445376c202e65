#!/usr/bin/env bash
# SLURM's own waits on the local clusters (docs/BENCHMARKS.md, "CI's test time": the SLURM files' waits),
# measured with `sleep` jobs so that the load of the machine matters little:
#   - submit: 6 one-node jobs, each from sbatch to RUNNING (squeue polled every 0.05 s);
#   - requeue: a two-node job whose tasks ignore SIGTERM (as submitit's ranks do), once every task
#     runs: `scontrol requeue` -> every task running again; then `scancel` -> gone from squeue;
#   - node loss: a two-node job, `cluster/local_slurm.sh kill-node 2` -> the job leaves RUNNING
#     (NODE_FAIL), then n2 started again.
#   bash benchmarks/slurm_waits.sh [submit|requeue|nodeloss ...]   (default: all three; root, both clusters up)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ONE=/tmp/paralayer-slurm/etc/slurm.conf
TWO_HOME=/tmp/paralayer-slurm-2node
TWO="$TWO_HOME/etc/slurm.conf"
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }
state() { SLURM_CONF="$1" squeue -h -j "$2" -o %T; }

submit() {
    local out="" k jid s i
    for k in 1 2 3 4 5 6; do
        s=$(now); jid=$(SLURM_CONF=$ONE sbatch --parsable -o /dev/null --wrap 'srun sleep 5')
        for i in $(seq 1 300); do [ "$(state $ONE "$jid")" = RUNNING ] && break; sleep 0.05; done
        out="$out $(since "$s")"; SLURM_CONF=$ONE scancel "$jid"; sleep 1.3
    done
    echo "submit -> RUNNING (s):$out"
}

requeue() {
    local d jid s i
    d=$(mktemp -d)
    jid=$(SLURM_CONF=$TWO sbatch --parsable -N2 --ntasks-per-node=1 --requeue -o /dev/null \
        --wrap "srun bash -c 'trap \"\" TERM; touch $d/\$SLURM_PROCID.\$SLURM_RESTART_COUNT; sleep 300'")
    tasks() { ls "$d" | grep -c "\.$1\$"; }
    for i in $(seq 1 600); do [ "$(tasks 0)" = 2 ] && break; sleep 0.05; done
    sleep 1; s=$(now); SLURM_CONF=$TWO scontrol requeue "$jid"
    for i in $(seq 1 1200); do [ "$(tasks 1)" = 2 ] && break; sleep 0.05; done
    echo "requeue -> every task running again: $(since "$s") s"
    sleep 1; s=$(now); SLURM_CONF=$TWO scancel "$jid"
    for i in $(seq 1 600); do [ -z "$(state $TWO "$jid")" ] && break; sleep 0.05; done
    echo "scancel -> gone from squeue: $(since "$s") s"
    rm -rf "$d"
}

nodeloss() {
    local jid s i st=""
    jid=$(SLURM_CONF=$TWO sbatch --parsable -N2 --ntasks-per-node=1 --requeue -o /dev/null --wrap 'srun sleep 300')
    for i in $(seq 1 200); do [ "$(state $TWO "$jid")" = RUNNING ] && break; sleep 0.2; done
    sleep 2; s=$(now)
    PARALAYER_SLURM_HOME=$TWO_HOME bash "$ROOT/cluster/local_slurm.sh" kill-node 2 --nodes 2 2>/dev/null
    for i in $(seq 1 400); do st=$(state $TWO "$jid"); [ "$st" != RUNNING ] && break; sleep 0.2; done
    echo "kill-node 2 -> job $st: $(since "$s") s"
    SLURM_CONF=$TWO scancel "$jid"
    PARALAYER_SLURM_HOME=$TWO_HOME bash "$ROOT/cluster/local_slurm.sh" start --nodes 2 >/dev/null 2>&1
}

for what in "${@:-submit requeue nodeloss}"; do
    for w in $what; do
        case "$w" in submit|requeue|nodeloss) "$w" ;; *) echo "usage: $0 [submit|requeue|nodeloss ...]" >&2; exit 2 ;; esac
    done
done
