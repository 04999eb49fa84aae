#!/usr/bin/env bash
# Build the registry-free Python base image openlab/python-base:bookworm:
#   mmdebstrap (Debian bookworm, python3 + venv + pip + ca-certificates) | docker import
# The host's extra CA certificates (/usr/local/share/ca-certificates/*.crt, or the files named in
# EXTRA_CA_CERTS_DIR) are copied into the rootfs and trusted, so pip works behind an intercepting proxy.
# Skips when the image exists (FORCE=1 rebuilds).
# Env: BASE_IMAGE (default openlab/python-base:bookworm), DEBIAN_SUITE (bookworm),
#      DEBIAN_MIRROR (default: mmdebstrap's default, i.e. the host's apt sources), EXTRA_CA_CERTS_DIR.
set -euo pipefail
LOG_TAG=base-image
source "$(dirname "$0")/../lib.sh"
need_root
IMAGE="${BASE_IMAGE:-openlab/python-base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
CA_DIR="${EXTRA_CA_CERTS_DIR:-/usr/local/share/ca-certificates}"

docker info >/dev/null 2>&1 || die "docker is not running (run infra/docker/start.sh)"
if [ "${FORCE:-0}" != 1 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "image $IMAGE exists ($(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)); skipping (FORCE=1 rebuilds)"
  exit 0
fi
command -v mmdebstrap >/dev/null || apt_install mmdebstrap
HOOKS=/usr/share/mmdebstrap/hooks/merged-usr
[ -d "$HOOKS" ] || die "$HOOKS missing (mmdebstrap too old?)"

# customize hook: install the extra CA certs, trust them, drop apt caches and docs to stay small
HOOK="$(mktemp -d)/customize.sh"
trap 'rm -rf "$(dirname "$HOOK")"' EXIT
cat >"$HOOK" <<'HOOKEOF'
#!/bin/sh
set -eu
root="$1"
if [ -n "${OPENLAB_CA_DIR:-}" ] && ls "$OPENLAB_CA_DIR"/*.crt >/dev/null 2>&1; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp "$OPENLAB_CA_DIR"/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
  echo "base-image hook: trusted $(ls "$OPENLAB_CA_DIR"/*.crt | wc -l) extra CA certificate(s)" >&2
fi
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
       "$root"/usr/share/man/* "$root"/usr/share/info/*
HOOKEOF
chmod +x "$HOOK"

MIRROR=()
[ -n "${DEBIAN_MIRROR:-}" ] && MIRROR=("$DEBIAN_MIRROR")
log "building $IMAGE from Debian $SUITE with mmdebstrap (CA dir: $CA_DIR)"
start=$SECONDS
OPENLAB_CA_DIR="$CA_DIR" mmdebstrap --variant=apt \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    --hook-dir="$HOOKS" \
    --customize-hook="$HOOK \"\$1\"" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    "$SUITE" - "${MIRROR[@]}" \
  | docker import \
      --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
      --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
      --change 'ENV PIP_NO_CACHE_DIR=1' \
      --change 'ENV PYTHONUNBUFFERED=1' \
      --change 'ENV LANG=C.UTF-8' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["python3"]' \
      --message "openlab python base ($SUITE, mmdebstrap)" \
      - "$IMAGE" >/dev/null
[ "${PIPESTATUS[0]}" -eq 0 ] || die "mmdebstrap failed"
docker image inspect "$IMAGE" >/dev/null 2>&1 || die "docker import did not produce $IMAGE"
log "built $IMAGE in $((SECONDS - start))s, size $(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)"
log "smoke test: $(docker run --rm --network none "$IMAGE" python -c 'import sys, ssl; print(sys.version.split()[0], ssl.OPENSSL_VERSION)')"
