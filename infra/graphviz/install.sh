#!/usr/bin/env bash
# Install Debian graphviz if missing and check that `dot` renders a graph: the tests feed it what
# `openlab lineage trace --dot` prints, as a user piping it to `dot -Tsvg` would.
# Prints the path of `dot` on the last line of stdout.
set -euo pipefail
LOG_TAG=graphviz-install
source "$(dirname "$0")/../lib.sh"
need_root
apt_install graphviz
BIN="$(command -v dot || true)"
[ -n "$BIN" ] || die "dot not found after installing graphviz"
echo 'digraph { a -> b }' | "$BIN" -Tsvg | grep -q '<svg' || die "dot ran but rendered no SVG (try: echo 'digraph { a -> b }' | dot -Tsvg)"
log "$("$BIN" -V 2>&1 | head -n 1) renders"
echo "$BIN"
