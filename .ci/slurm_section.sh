#!/usr/bin/env bash
# CI fragment (called by .ci/run): the real SLURM clusters the tests run against.
#
#   bash .ci/slurm_section.sh start   # install the packages; start the one-node cluster
#                                     # (/tmp/paralayer-slurm, or $PARALAYER_SLURM_HOME) and the
#                                     # two-node one (one network namespace per node,
#                                     # /tmp/paralayer-slurm-2node); a smoke job on each; write
#                                     # .ci/slurm.env (the one-node `export SLURM_CONF=...`)
#   bash .ci/slurm_section.sh stop    # stop both (daemons by pid file; namespaces and links removed)
#
# The two clusters coexist: own munged, own state folder, and the two-node daemons live in their
# own network namespaces (own loopback and ports). The tests reach the two-node one through the
# profile local-slurm-2node (its slurm.conf path), so SLURM_CONF stays the one-node cluster's.
# Any failure here (no package mirror, a cluster that does not come up) is exit 1 after the logs:
# .ci/run sets PARALAYER_REQUIRE_SLURM=1, so a missing SLURM fails the SLURM tests anyway.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENVFILE="$ROOT/.ci/slurm.env"
TWO_HOME=/tmp/paralayer-slurm-2node   # cluster/profiles/local-slurm-2node.yaml names it

smoke() {  # smoke SLURM_CONF SBATCH_ARGS... : one job to COMPLETED within 30 s
    local conf="$1" jid st="" i; shift
    jid="$(SLURM_CONF="$conf" sbatch --parsable -o /dev/null "$@" --wrap 'srun true')" \
        || { echo "slurm_section: ERROR: sbatch failed ($conf)" >&2; return 1; }
    for i in $(seq 1 150); do
        st="$(SLURM_CONF="$conf" sacct -n -X -j "$jid" -o State 2>/dev/null | tr -d ' ')"
        [ "$st" = COMPLETED ] && break
        sleep 0.2
    done
    [ "$st" = COMPLETED ] || { echo "slurm_section: ERROR: smoke job $jid not COMPLETED after 30 s (state: ${st:-?})" >&2; return 1; }
    echo "slurm_section: smoke job $jid ($*) COMPLETED on $conf"
}

start() {
    local out t0; t0=$(date +%s)
    rm -f "$ENVFILE"
    bash "$ROOT/cluster/install_slurm_deps.sh" || { echo "slurm_section: ERROR: could not install the SLURM packages" >&2; return 1; }
    out="$(bash "$ROOT/cluster/local_slurm.sh" start)" || { echo "slurm_section: ERROR: the one-node SLURM did not start (logs above)" >&2; return 1; }
    echo "$out" | grep '^export SLURM_CONF=' > "$ENVFILE"
    PARALAYER_SLURM_HOME="$TWO_HOME" bash "$ROOT/cluster/local_slurm.sh" start --nodes 2 >/dev/null \
        || { echo "slurm_section: ERROR: the two-node SLURM did not start (logs above)" >&2; return 1; }
    # shellcheck disable=SC1090
    source "$ENVFILE"
    sinfo && SLURM_CONF="$TWO_HOME/etc/slurm.conf" sinfo -N
    smoke "$SLURM_CONF" || return 1
    smoke "$TWO_HOME/etc/slurm.conf" -N 2 --ntasks-per-node=1 || return 1
    echo "slurm_section: both clusters up in $(( $(date +%s) - t0 )) s; $(cat "$ENVFILE")"
}

stop() {
    PARALAYER_SLURM_HOME="$TWO_HOME" bash "$ROOT/cluster/local_slurm.sh" stop --nodes 2 || true
    bash "$ROOT/cluster/local_slurm.sh" stop || true
    rm -f "$ENVFILE"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
