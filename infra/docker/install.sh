#!/usr/bin/env bash
# Install the Docker engine (Debian docker.io: dockerd + containerd + runc) if missing.
set -euo pipefail
LOG_TAG=docker-install
source "$(dirname "$0")/../lib.sh"
need_root
if command -v dockerd >/dev/null && command -v docker >/dev/null; then
  log "docker already installed: $(dockerd --version 2>/dev/null || true)"
  exit 0
fi
apt_install docker.io
command -v dockerd >/dev/null || die "dockerd still missing after installing docker.io"
log "installed: $(dockerd --version)"
