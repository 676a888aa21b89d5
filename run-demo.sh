#!/usr/bin/env bash
# The main job on the default model (see README.md).
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
exec .venv/bin/kafila run --model smollm2-135m --stages 3 "${@:-Name three uses of a pooled home computer cluster.}"
