#!/usr/bin/env bash
# Makes sure promtool (Debian `prometheus`) is installed, for the metrics test's `promtool check metrics`
# (server/tests/api/metrics.rs). Installs it from Debian's packages as root when missing. Safe to run again. Never fails the
# run: without it the test says it skipped, and fails under CI (`CI` set), where this runs as root and must work.
set -uo pipefail

log() { printf 'promtool: %s\n' "$*" >&2; }

if ! command -v promtool >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    log "WARNING: promtool missing and not root: the metrics test's promtool check will skip (and fail under CI)"
    exit 0
  fi
  log "installing prometheus (for promtool)"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
    log "WARNING: could not install prometheus: the metrics test's promtool check will skip (and fail under CI)"
    exit 0
  fi
fi
log "$(promtool --version 2>&1 | head -1)"
