#!/usr/bin/env bash
# Install Slurm (Debian slurm-wlm, 22.05) + munge; with --with-accounting also slurmdbd + mariadb-server.
set -euo pipefail
LOG_TAG=slurm-install
source "$(dirname "$0")/../lib.sh"
need_root
PKGS=(slurm-wlm munge)
[ "${1:-}" = "--with-accounting" ] && PKGS+=(slurmdbd mariadb-server)
[ $# -gt 0 ] && [ "$1" != "--with-accounting" ] && die "usage: $0 [--with-accounting]"
apt_install "${PKGS[@]}"
# Debian's munge postinst creates the key; make sure one exists (e.g. when the package was unpacked by hand)
if [ ! -s /etc/munge/munge.key ]; then
  log "creating /etc/munge/munge.key"
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
  else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; fi
  chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key
fi
log "slurm $(slurmd -V 2>/dev/null | awk '{print $2}') and munge $(munged -V 2>/dev/null | awk '{print $1}' | sed 's/munge-//') installed"
