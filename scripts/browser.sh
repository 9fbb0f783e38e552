#!/usr/bin/env bash
# Makes sure a headless Chromium and its WebDriver (Debian `chromium`, `chromium-driver`) are installed, for the
# operator UI's browser test (server/tests/api/ui.rs). Installs them from Debian's packages as root when missing; never
# downloads a browser from anywhere else. Safe to run again. Never fails the run: without them the browser test says
# it skipped (and fails under CI, where this script runs as root and the install must work).
set -uo pipefail

log() { printf 'browser: %s\n' "$*" >&2; }

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    log "WARNING: chromium/chromedriver missing and not root: the UI browser test will skip"
    exit 0
  fi
  log "installing chromium chromium-driver"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           chromium chromium-driver fonts-dejavu-core >/dev/null; }; then
    log "WARNING: could not install chromium chromium-driver: the UI browser test will skip"
    exit 0
  fi
fi
log "$(chromium --version 2>/dev/null); $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
