# shellcheck shell=bash
# Common helpers for openlab infra scripts. Source it; do not execute it.
# Everything a script writes (logs, pid files, configs) lives under $OPENLAB_INFRA_STATE.

OPENLAB_INFRA_STATE="${OPENLAB_INFRA_STATE:-/var/tmp/openlab-infra}"
export OPENLAB_INFRA_STATE
INFRA_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$INFRA_DIR/.." && pwd)"

log()  { printf '[%s] %s\n' "${LOG_TAG:-infra}" "$*" >&2; }
die()  { printf '[%s] ERROR: %s\n' "${LOG_TAG:-infra}" "$*" >&2; exit 1; }
run()  { log "+ $*"; "$@"; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (daemons are started directly, no systemd); try: sudo $0 $*"
}

ensure_state_dir() { mkdir -p "$OPENLAB_INFRA_STATE"; }

# apt_install PKG... : installs only the packages that are missing; waits for dpkg locks.
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    log "already installed: $*"
    return 0
  fi
  command -v apt-get >/dev/null || die "apt-get not found; install manually: ${missing[*]}"
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  local apt_opts=(-o DPkg::Lock::Timeout=600 -y --no-install-recommends)
  # refresh the package lists once if they are missing or the install fails
  if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    run apt-get -o DPkg::Lock::Timeout=600 update -q || die "apt-get update failed"
  fi
  if ! run apt-get install "${apt_opts[@]}" "${missing[@]}"; then
    run apt-get -o DPkg::Lock::Timeout=600 update -q || die "apt-get update failed"
    run apt-get install "${apt_opts[@]}" "${missing[@]}" || die "apt-get install ${missing[*]} failed"
  fi
}

# wait_for TIMEOUT_S DESCRIPTION CMD... : polls CMD every 0.5 s until it succeeds.
wait_for() {
  local timeout="$1" what="$2"; shift 2
  local start=$SECONDS
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS - start >= timeout )); then
      log "timed out after ${timeout}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
  log "$what ready after $((SECONDS - start))s"
}

# pid_alive PIDFILE : true when the pidfile names a live process.
pid_alive() {
  local f="$1" pid
  [ -s "$f" ] || return 1
  pid="$(cat "$f")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# stop_pidfile NAME PIDFILE [TIMEOUT_S] : SIGTERM, wait, then SIGKILL; removes the pidfile.
stop_pidfile() {
  local name="$1" f="$2" timeout="${3:-20}" pid i
  if ! pid_alive "$f"; then
    log "$name not running"
    rm -f "$f"
    return 0
  fi
  pid="$(cat "$f")"
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < timeout * 2; i++)); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$f"; log "$name stopped"; return 0; }
    sleep 0.5
  done
  log "$name did not exit after ${timeout}s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$f"
}
