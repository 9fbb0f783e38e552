#!/usr/bin/env bash
# Installs moto's S3 server (PyPI `moto[server]`) for the object storage tests against real S3 requests
# (server/tests/api/s3.rs: they start it on a free loopback port), into $CONVEYOR_TOOLS_DIR/moto. Safe to run again;
# fails when it cannot install (the tests would fail without it, never skip).
set -euo pipefail
tools="${CONVEYOR_TOOLS_DIR:-$HOME/.cache/conveyor-tools}"
venv="$tools/moto"
if [ ! -x "$venv/bin/moto_server" ]; then
  echo "s3: installing moto[server] into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet 'moto[server]>=5,<6' || { echo "s3: could not install moto[server] from PyPI" >&2; exit 1; }
fi
"$venv/bin/python" -c 'import moto; print("s3: moto", moto.__version__, "at '"$venv"'/bin/moto_server")' >&2
