#!/usr/bin/env bash
# Start PostgreSQL (Debian cluster "main" of the newest installed version) without systemd and create
# the test role/databases: role openlab (password openlab, CREATEDB), databases openlab and openlab_test.
# Installs postgresql if missing. Idempotent. Prints the SQLAlchemy URL on the last line of stdout.
# Env: OPENLAB_PG_USER / OPENLAB_PG_PASSWORD (openlab/openlab), OPENLAB_PG_DATABASES ("openlab openlab_test").
set -euo pipefail
LOG_TAG=postgres-start
source "$(dirname "$0")/../lib.sh"
need_root
PGU="${OPENLAB_PG_USER:-openlab}"
PGP="${OPENLAB_PG_PASSWORD:-openlab}"
DBS="${OPENLAB_PG_DATABASES:-openlab openlab_test}"

command -v pg_ctlcluster >/dev/null && ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || apt_install postgresql
VER="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"
[ -n "$VER" ] || die "no PostgreSQL server found under /usr/lib/postgresql"
if ! pg_lsclusters -h | awk -v v="$VER" '$1 == v && $2 == "main"' | grep -q .; then
  log "creating cluster $VER/main"
  pg_createcluster "$VER" main >/dev/null || die "pg_createcluster $VER main failed"
fi
status() { pg_lsclusters -h | awk -v v="$VER" '$1 == v && $2 == "main" {print $4}'; }
PORT="$(pg_lsclusters -h | awk -v v="$VER" '$1 == v && $2 == "main" {print $3}')"
if [ "$(status)" = online ]; then
  log "cluster $VER/main already online on port $PORT"
else
  # a pid file left by a killed server blocks the start
  PIDF="/var/lib/postgresql/$VER/main/postmaster.pid"
  if [ -f "$PIDF" ] && ! kill -0 "$(head -n 1 "$PIDF")" 2>/dev/null; then log "removing stale $PIDF"; rm -f "$PIDF"; fi
  mkdir -p /var/run/postgresql && chown postgres:postgres /var/run/postgresql
  log "starting cluster $VER/main (log /var/log/postgresql/postgresql-$VER-main.log)"
  pg_ctlcluster "$VER" main start || { tail -n 20 "/var/log/postgresql/postgresql-$VER-main.log" >&2; die "pg_ctlcluster $VER main start failed"; }
fi
psql_admin() { runuser -u postgres -- psql -p "$PORT" -v ON_ERROR_STOP=1 -qtAX "$@"; }
wait_for 30 "postgres $VER on port $PORT" psql_admin -c 'select 1' || die "postgres does not accept connections"

if [ "$(psql_admin -c "select 1 from pg_roles where rolname = '$PGU'")" = 1 ]; then
  psql_admin -c "alter role \"$PGU\" with login createdb password '$PGP'"
  log "role $PGU exists (password reset)"
else
  psql_admin -c "create role \"$PGU\" with login createdb password '$PGP'"
  log "created role $PGU"
fi
for db in $DBS; do
  if [ "$(psql_admin -c "select 1 from pg_database where datname = '$db'")" = 1 ]; then
    log "database $db exists"
  else
    psql_admin -c "create database \"$db\" owner \"$PGU\""
    log "created database $db"
  fi
done
last="${DBS##* }"
PGPASSWORD="$PGP" psql -h 127.0.0.1 -p "$PORT" -U "$PGU" -d "$last" -qtAX -c 'select 1' >/dev/null \
  || die "password login as $PGU@127.0.0.1:$PORT/$last failed (check pg_hba.conf)"
log "postgres $VER ready on 127.0.0.1:$PORT"
echo "postgresql+psycopg://$PGU:$PGP@127.0.0.1:$PORT/$last"
