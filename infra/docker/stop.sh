#!/usr/bin/env bash
# Stop the dockerd started by start.sh (SIGTERM, then SIGKILL after a timeout). Idempotent.
set -euo pipefail
LOG_TAG=docker-stop
source "$(dirname "$0")/../lib.sh"
need_root
PIDFILE="$OPENLAB_INFRA_STATE/docker.pid"
if ! pid_alive "$PIDFILE" && [ -s /var/run/docker.pid ] && kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
  log "dockerd was not started by start.sh; stopping pid $(cat /var/run/docker.pid) from /var/run/docker.pid"
  PIDFILE=/var/run/docker.pid
fi
stop_pidfile dockerd "$PIDFILE" "${DOCKER_STOP_TIMEOUT:-30}"
rm -f /var/run/docker.pid
