#!/usr/bin/env bash
# Stop slurmd, slurmctld (and slurmdbd, mariadb, munged when start.sh started them). Idempotent.
# --keep-munge leaves munged (and the accounting database) running.
set -euo pipefail
LOG_TAG=slurm-stop
source "$(dirname "$0")/../lib.sh"
need_root
S="$OPENLAB_INFRA_STATE/slurm"
stop_pidfile slurmd "$S/slurmd.pid" 20
stop_pidfile slurmctld "$S/slurmctld.pid" 20
[ "${1:-}" = "--keep-munge" ] && exit 0
stop_pidfile slurmdbd "$S/slurmdbd.pid" 20
stop_pidfile mariadb "$S/mariadb.pid" 30
stop_pidfile munged "$S/munged.pid" 10
