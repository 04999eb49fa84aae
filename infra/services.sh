#!/usr/bin/env bash
# Bring the local test services up or down and record what is available for the tests.
#   infra/services.sh up       docker (+ base image + job image), slurm, postgres, browser, graphviz; continues past failures
#   infra/services.sh down     stops docker, slurm, postgres (chromium and graphviz are not daemons)
#   infra/services.sh status   checks each service live and prints the env file
# Writes $OPENLAB_INFRA_STATE/services.env (default /var/tmp/openlab-infra/services.env): KEY=VALUE lines,
# shell-sourceable (`set -a; . services.env`) and read by tests/services.py. A service that failed is
# recorded as =0 with OPENLAB_TEST_<NAME>_REASON=...; each step's full output is in $OPENLAB_INFRA_STATE/logs/.
# Env: OPENLAB_SERVICES="docker slurm postgres browser graphviz" (subset to bring up),
#      OPENLAB_JOB_IMAGE=torch|notorch|skip (default torch: openlab/job:latest with a CPU torch;
#      notorch: openlab/job:latest without torch), OPENLAB_STEP_TIMEOUT (default 1200 s per step),
#      OPENLAB_SLURM_ACCOUNTING=0 (Slurm without mariadb + slurmdbd: no sacct, no measured job usage).
set -uo pipefail
LOG_TAG=services
source "$(dirname "$0")/lib.sh"
ENVFILE="$OPENLAB_INFRA_STATE/services.env"
LOGS="$OPENLAB_INFRA_STATE/logs"
SERVICES="${OPENLAB_SERVICES:-docker slurm postgres browser graphviz}"
STEP_TIMEOUT="${OPENLAB_STEP_TIMEOUT:-1200}"
declare -A KV=()
ORDER=()

setkv() { [ -n "${KV[$1]+x}" ] || ORDER+=("$1"); KV[$1]="$2"; }
quote() {  # single-quote a value for the shell when it needs it
  local v="${1//$'\n'/ }"; v="${v//\'/}"
  if [[ "$v" =~ ^[A-Za-z0-9_./:@+=,-]*$ ]]; then printf '%s' "$v"; else printf "'%s'" "$v"; fi
}
write_env() {
  mkdir -p "$OPENLAB_INFRA_STATE"
  local tmp="$ENVFILE.tmp.$$" k
  { echo "# written by infra/services.sh $CMD at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    for k in "${ORDER[@]}"; do printf '%s=%s\n' "$k" "$(quote "${KV[$k]}")"; done
  } >"$tmp" && mv "$tmp" "$ENVFILE"
}
declare -a SUMMARY=()
# step NAME CMD... : runs CMD with a timeout, output to $LOGS/NAME.log (and the terminal), times it.
# Sets STEP_OUT (last stdout line) and STEP_REASON (last error line) for the caller.
step() {
  local name="$1"; shift
  local start=$SECONDS rc log="$LOGS/$name.log"
  mkdir -p "$LOGS"
  log "==> $name: $*"
  timeout "$STEP_TIMEOUT" "$@" >"$log.out" 2> >(tee "$log" >&2)
  rc=$?
  sleep 0.1   # let tee flush
  STEP_OUT="$(tail -n 1 "$log.out" 2>/dev/null)"
  cat "$log.out" >>"$log"; rm -f "$log.out"
  local dur=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    STEP_REASON=""
    SUMMARY+=("$(printf '%-16s ok     %4ss' "$name" "$dur")")
  else
    [ $rc -eq 124 ] && STEP_REASON="$name timed out after ${STEP_TIMEOUT}s" \
      || STEP_REASON="$(grep -E '^\[[a-z-]+\] ERROR: ' "$log" | tail -n 1 | sed 's/^[^]]*\] ERROR: //' | cut -c1-200)"
    [ -n "$STEP_REASON" ] || STEP_REASON="$name exited $rc: $(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-160)"
    SUMMARY+=("$(printf '%-16s FAILED %4ss  %s' "$name" "$dur" "$STEP_REASON")")
  fi
  log "<== $name: rc=$rc in ${dur}s"
  return $rc
}
wants() { [[ " $SERVICES " == *" $1 "* ]]; }
# A service left out of OPENLAB_SERVICES keeps what the last `up` recorded for it (bringing one tool up
# must not mark the running daemons down); with nothing recorded it is "not requested".
not_requested() {  # not_requested KEY
  [ -n "${KV[$1]+x}" ] && return 0
  setkv "$1" 0; setkv "${1}_REASON" "not requested (OPENLAB_SERVICES)"
}
load_previous() {
  [ -f "$ENVFILE" ] || return 0
  local line
  while IFS= read -r line; do
    [[ "$line" =~ ^([A-Z][A-Z0-9_]*)=(.*)$ ]] || continue
    local v="${BASH_REMATCH[2]}"; v="${v#\'}"; v="${v%\'}"
    setkv "${BASH_REMATCH[1]}" "$v"
  done <"$ENVFILE"
}
# A program the tests run, not a daemon (chromium, graphviz): install it and record its path, or why not.
tool() {  # tool NAME KEY SCRIPT
  local name="$1" key="$2" script="$3"
  if wants "$name"; then
    if step "$name" "$script"; then
      setkv "$key" "$STEP_OUT"; setkv "${key}_REASON" ""
    else
      setkv "$key" 0; setkv "${key}_REASON" "$STEP_REASON"
    fi
    write_env
  else
    not_requested "$key"
  fi
}

up() {
  [ -n "${OPENLAB_SERVICES:-}" ] && load_previous
  setkv OPENLAB_INFRA_STATE "$OPENLAB_INFRA_STATE"
  if [ "$(id -u)" -ne 0 ]; then
    for s in DOCKER SLURM POSTGRES CHROMIUM GRAPHVIZ; do setkv "OPENLAB_TEST_$s" 0; setkv "OPENLAB_TEST_${s}_REASON" "infra/services.sh up was not run as root"; done
    write_env; die "must run as root (daemons are started directly, there is no systemd)"
  fi
  local total=$SECONDS
  if wants docker; then
    if step docker-install "$INFRA_DIR/docker/install.sh" && step docker-start "$INFRA_DIR/docker/start.sh"; then
      setkv OPENLAB_TEST_DOCKER 1; setkv OPENLAB_TEST_DOCKER_REASON ""
    else
      setkv OPENLAB_TEST_DOCKER 0; setkv OPENLAB_TEST_DOCKER_REASON "$STEP_REASON"
    fi
    write_env
  else
    not_requested OPENLAB_TEST_DOCKER
  fi
  if wants slurm; then
    # with accounting (mariadb + slurmdbd), as a real cluster has: sacct, and what each job used
    acct=(--with-accounting); [ "${OPENLAB_SLURM_ACCOUNTING:-1}" = 0 ] && acct=()
    if step slurm "$INFRA_DIR/slurm/start.sh" "${acct[@]}"; then
      setkv OPENLAB_TEST_SLURM 1; setkv OPENLAB_TEST_SLURM_REASON ""; setkv SLURM_CONF "${STEP_OUT#SLURM_CONF=}"
      if [ ${#acct[@]} -gt 0 ]; then setkv OPENLAB_TEST_SLURM_ACCOUNTING 1; setkv OPENLAB_TEST_SLURM_ACCOUNTING_REASON ""
      else setkv OPENLAB_TEST_SLURM_ACCOUNTING 0; setkv OPENLAB_TEST_SLURM_ACCOUNTING_REASON "OPENLAB_SLURM_ACCOUNTING=0"; fi
    else
      setkv OPENLAB_TEST_SLURM 0; setkv OPENLAB_TEST_SLURM_REASON "$STEP_REASON"
      setkv OPENLAB_TEST_SLURM_ACCOUNTING 0; setkv OPENLAB_TEST_SLURM_ACCOUNTING_REASON "slurm: $STEP_REASON"
    fi
    write_env
  else
    not_requested OPENLAB_TEST_SLURM
  fi
  if wants postgres; then
    if step postgres "$INFRA_DIR/postgres/start.sh"; then
      setkv OPENLAB_TEST_POSTGRES 1; setkv OPENLAB_TEST_POSTGRES_REASON ""; setkv OPENLAB_TEST_POSTGRES_URL "$STEP_OUT"
    else
      setkv OPENLAB_TEST_POSTGRES 0; setkv OPENLAB_TEST_POSTGRES_REASON "$STEP_REASON"; setkv OPENLAB_TEST_POSTGRES_URL ""
    fi
    write_env
  else
    not_requested OPENLAB_TEST_POSTGRES
  fi
  tool browser OPENLAB_TEST_CHROMIUM "$INFRA_DIR/browser/install.sh"
  tool graphviz OPENLAB_TEST_GRAPHVIZ "$INFRA_DIR/graphviz/install.sh"
  # images last: the slow part, and the other services are usable meanwhile
  if wants docker && [ "${KV[OPENLAB_TEST_DOCKER]}" = 1 ]; then
    if step base-image "$INFRA_DIR/docker/build-base-image.sh"; then
      setkv OPENLAB_TEST_DOCKER_BASE_IMAGE "${BASE_IMAGE:-openlab/python-base:bookworm}"; setkv OPENLAB_TEST_DOCKER_BASE_IMAGE_REASON ""
    else
      setkv OPENLAB_TEST_DOCKER_BASE_IMAGE ""; setkv OPENLAB_TEST_DOCKER_BASE_IMAGE_REASON "$STEP_REASON"
    fi
    write_env
    local mode="${OPENLAB_JOB_IMAGE:-torch}" args=()
    [ "$mode" = notorch ] && args=(--no-torch)
    if [ "$mode" = skip ]; then
      setkv OPENLAB_TEST_DOCKER_JOB_IMAGE ""; setkv OPENLAB_TEST_DOCKER_JOB_IMAGE_REASON "skipped (OPENLAB_JOB_IMAGE=skip)"
    elif [ -z "${KV[OPENLAB_TEST_DOCKER_BASE_IMAGE]}" ]; then
      setkv OPENLAB_TEST_DOCKER_JOB_IMAGE ""; setkv OPENLAB_TEST_DOCKER_JOB_IMAGE_REASON "no base image"
    elif step job-image "$INFRA_DIR/docker/build-job-image.sh" "${args[@]}"; then
      setkv OPENLAB_TEST_DOCKER_JOB_IMAGE "${JOB_IMAGE:-openlab/job:latest}"; setkv OPENLAB_TEST_DOCKER_JOB_IMAGE_REASON ""
    else
      setkv OPENLAB_TEST_DOCKER_JOB_IMAGE ""; setkv OPENLAB_TEST_DOCKER_JOB_IMAGE_REASON "$STEP_REASON"
    fi
    write_env
  fi
  write_env
  log "summary (total $((SECONDS - total))s):"
  printf '  %s\n' "${SUMMARY[@]}" >&2
  log "wrote $ENVFILE:"
  grep -v '^#' "$ENVFILE" | sed 's/^/  /' >&2
}

down() {
  [ "$(id -u)" -eq 0 ] || die "must run as root"
  local rc=0
  "$INFRA_DIR/postgres/stop.sh" || rc=1
  "$INFRA_DIR/slurm/stop.sh" || rc=1
  "$INFRA_DIR/docker/stop.sh" || rc=1
  setkv OPENLAB_INFRA_STATE "$OPENLAB_INFRA_STATE"
  for s in DOCKER SLURM POSTGRES; do setkv "OPENLAB_TEST_$s" 0; setkv "OPENLAB_TEST_${s}_REASON" "stopped by infra/services.sh down"; done
  setkv OPENLAB_TEST_POSTGRES_URL ""
  # chromium is a binary, not a daemon: keep its entry if it was installed
  if [ -x /usr/bin/chromium ]; then setkv OPENLAB_TEST_CHROMIUM /usr/bin/chromium; setkv OPENLAB_TEST_CHROMIUM_REASON ""; fi
  if [ -x /usr/bin/dot ]; then setkv OPENLAB_TEST_GRAPHVIZ /usr/bin/dot; setkv OPENLAB_TEST_GRAPHVIZ_REASON ""; fi
  write_env
  log "services down; wrote $ENVFILE"
  return $rc
}

status() {
  local rc=0
  if docker info >/dev/null 2>&1; then log "docker:   up ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'); images: $(docker images --format '{{.Repository}}:{{.Tag}}' | grep '^openlab/' | tr '\n' ' '))"
  else log "docker:   DOWN"; rc=1; fi
  local conf="$OPENLAB_INFRA_STATE/slurm/etc/slurm.conf"
  if [ -f "$conf" ] && SLURM_CONF="$conf" scontrol ping >/dev/null 2>&1; then
    log "slurm:    up (SLURM_CONF=$conf; node $(SLURM_CONF="$conf" sinfo -h -N -o '%N %T' | head -n 1))"
  else log "slurm:    DOWN"; rc=1; fi
  if command -v pg_lsclusters >/dev/null && pg_lsclusters -h | awk '$2 == "main" && $4 == "online"' | grep -q .; then
    log "postgres: up ($(pg_lsclusters -h | awk '$2 == "main" {print $1 "/main port " $3}'))"
  else log "postgres: DOWN"; rc=1; fi
  if [ -x /usr/bin/chromium ]; then log "chromium: installed ($(/usr/bin/chromium --version 2>/dev/null | head -n 1))"
  else log "chromium: NOT INSTALLED"; rc=1; fi
  if [ -x /usr/bin/dot ]; then log "graphviz: installed ($(/usr/bin/dot -V 2>&1 | head -n 1))"
  else log "graphviz: NOT INSTALLED"; rc=1; fi
  if [ -f "$ENVFILE" ]; then log "$ENVFILE:"; grep -v '^#' "$ENVFILE" | sed 's/^/  /' >&2
  else log "no $ENVFILE yet (run: infra/services.sh up)"; fi
  return $rc
}

CMD="${1:-}"
case "$CMD" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
