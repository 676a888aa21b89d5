#!/usr/bin/env bash
# The whole test suite (see README.md). Lab tests need root and iptables; they skip with a reason otherwise.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -rs "$@"
