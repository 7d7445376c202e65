#!/usr/bin/env bash
# CI fragment (called by .ci/run): install the SLURM packages, start the one-node SLURM of
# cluster/local_slurm.sh and write .ci/slurm.env (the `export SLURM_CONF=...` line) for .ci/run
# to source. If the packages cannot be installed (no package mirror) it warns and writes no
# slurm.env, so the SLURM tests skip with their reason; if the packages are there but the cluster
# does not come up, that is a bug in our script: it fails (exit 1) after printing the daemon logs.
# Works run (bash .ci/slurm_section.sh) or sourced.
_paralayer_slurm_section() {
    local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local envfile="$root/.ci/slurm.env"
    rm -f "$envfile"
    if ! bash "$root/cluster/install_slurm_deps.sh"; then
        echo "slurm_section: WARNING: could not install the SLURM packages; SLURM tests will skip" >&2
        return 0
    fi
    local out
    if ! out="$(bash "$root/cluster/local_slurm.sh" start)"; then
        echo "slurm_section: ERROR: the local SLURM did not start (logs above)" >&2
        return 1
    fi
    echo "$out" | grep '^export SLURM_CONF=' > "$envfile"
    # shellcheck disable=SC1090
    source "$envfile"
    echo "slurm_section: $(cat "$envfile")"
    sinfo
    # a smoke job, with a deadline
    local jid st="" i
    jid="$(sbatch --parsable -o /dev/null --wrap true)" || { echo "slurm_section: ERROR: sbatch failed" >&2; return 1; }
    for i in $(seq 1 150); do
        st="$(sacct -n -X -j "$jid" -o State 2>/dev/null | tr -d ' ')"
        [ "$st" = COMPLETED ] && break
        sleep 0.2
    done
    if [ "$st" != COMPLETED ]; then
        echo "slurm_section: ERROR: smoke job $jid not COMPLETED after 30 s (state: ${st:-?})" >&2
        return 1
    fi
    echo "slurm_section: smoke job $jid COMPLETED"
}
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -uo pipefail
    _paralayer_slurm_section; exit $?
else
    _paralayer_slurm_section
fi
