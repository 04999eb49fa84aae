#!/usr/bin/env bash
# Start dockerd in the background (no systemd): no iptables, no bridge (containers get only lo;
# --network none and --network host work). Storage driver: overlay2 when an overlay mount works here
# (measured: a container of a 1.6 GB image starts in <1 s), else vfs (copies the whole image for every
# container and build step: minutes for big images). If overlay2 fails to come up, falls back to vfs.
# Idempotent: does nothing when `docker info` already answers.
# Env: OPENLAB_INFRA_STATE (logs/pid), DOCKER_START_TIMEOUT (default 60 s),
#      OPENLAB_DOCKER_STORAGE_DRIVER (overlay2|vfs; default: auto), OPENLAB_DOCKERD_ARGS (extra dockerd flags).
set -euo pipefail
LOG_TAG=docker-start
source "$(dirname "$0")/../lib.sh"
need_root
ensure_state_dir
LOGFILE="$OPENLAB_INFRA_STATE/docker.log"
PIDFILE="$OPENLAB_INFRA_STATE/docker.pid"
TIMEOUT="${DOCKER_START_TIMEOUT:-60}"

command -v dockerd >/dev/null || "$INFRA_DIR/docker/install.sh"

if docker info >/dev/null 2>&1; then
  log "docker already running ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}' 2>/dev/null))"
  exit 0
fi

overlay_works() {
  local probe rc=1
  probe="$(mktemp -d)"
  mkdir -p "$probe"/{l,u,w,m}
  if mount -t overlay overlay -o "lowerdir=$probe/l,upperdir=$probe/u,workdir=$probe/w" "$probe/m" 2>/dev/null; then
    umount "$probe/m"; rc=0
  fi
  rm -rf "$probe"
  return $rc
}

launch() {  # launch DRIVER
  # a stale pid file left by a killed dockerd blocks the next start
  if [ -e /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid 2>/dev/null)" 2>/dev/null; then
    log "removing stale /var/run/docker.pid"; rm -f /var/run/docker.pid
  fi
  log "starting dockerd, storage driver $1 (log: $LOGFILE)"
  # shellcheck disable=SC2086
  nohup dockerd --storage-driver="$1" --iptables=false --bridge=none \
      --pidfile /var/run/docker.pid ${OPENLAB_DOCKERD_ARGS:-} >>"$LOGFILE" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
}

if pid_alive "$PIDFILE"; then
  log "dockerd (pid $(cat "$PIDFILE")) is starting; waiting"
  DRIVER=""
else
  DRIVER="${OPENLAB_DOCKER_STORAGE_DRIVER:-}"
  if [ -z "$DRIVER" ]; then
    if overlay_works; then DRIVER=overlay2; else DRIVER=vfs; log "overlay mounts do not work here; using vfs"; fi
  fi
  launch "$DRIVER"
fi

if ! wait_for "$TIMEOUT" "docker info" docker info; then
  tail -n 20 "$LOGFILE" >&2 || true
  if [ "$DRIVER" = overlay2 ] && [ -z "${OPENLAB_DOCKER_STORAGE_DRIVER:-}" ]; then
    log "overlay2 did not come up; retrying with vfs"
    stop_pidfile dockerd "$PIDFILE" 20
    launch vfs
    wait_for "$TIMEOUT" "docker info" docker info || die "dockerd (vfs) did not become ready within ${TIMEOUT}s (see $LOGFILE)"
  else
    die "dockerd did not become ready within ${TIMEOUT}s (see $LOGFILE)"
  fi
fi
log "docker ready: $(docker info --format 'server {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}')"
