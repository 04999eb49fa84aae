#!/usr/bin/env bash
# Install Debian chromium + chromium-driver if missing and check that headless Chromium renders a page.
# Prints the browser path on the last line of stdout (for playwright: executable_path=...).
set -euo pipefail
LOG_TAG=browser-install
source "$(dirname "$0")/../lib.sh"
need_root
apt_install chromium chromium-driver
BIN="$(command -v chromium || true)"
[ -n "$BIN" ] || die "chromium binary not found after install"
log "$($BIN --version 2>/dev/null | head -n 1); $(chromedriver --version 2>/dev/null | head -n 1)"
PROFILE="$(mktemp -d)"
trap 'rm -rf "$PROFILE"' EXIT
DOM="$(timeout 60 "$BIN" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$PROFILE" --dump-dom 'data:text/html,<p id=x>openlab-ok</p>' 2>/dev/null)" \
  || die "headless chromium failed to start (try: $BIN --headless --no-sandbox --dump-dom about:blank)"
grep -q openlab-ok <<<"$DOM" || die "headless chromium ran but rendered no DOM: ${DOM:0:200}"
log "headless chromium works"
echo "$BIN"
