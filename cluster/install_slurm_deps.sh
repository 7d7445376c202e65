#!/usr/bin/env bash
# Install the Debian packages a local one-node SLURM needs (see cluster/local_slurm.sh).
# Idempotent: does nothing when every package is already installed.
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_slurm_deps: all packages already installed (${PKGS[*]})"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_slurm_deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1
    fi
fi

echo "install_slurm_deps: installing ${missing[*]}"
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_slurm_deps: done"
