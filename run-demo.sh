#!/usr/bin/env bash
# The main job on the default model (see README.md): a 3-member session on this machine.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
exec .venv/bin/kafila demo "$@"
