#!/usr/bin/env bash
# Stop the PostgreSQL cluster "main" (fast shutdown). Idempotent.
set -euo pipefail
LOG_TAG=postgres-stop
source "$(dirname "$0")/../lib.sh"
need_root
command -v pg_lsclusters >/dev/null || { log "postgresql not installed"; exit 0; }
pg_lsclusters -h | while read -r ver name port status _; do
  [ "$name" = main ] || continue
  if [ "$status" = online ]; then
    log "stopping cluster $ver/$name (port $port)"
    pg_ctlcluster "$ver" "$name" stop -m fast || die "pg_ctlcluster $ver $name stop failed"
  else
    log "cluster $ver/$name not running"
  fi
done
