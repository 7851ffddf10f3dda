#!/usr/bin/env bash
# Re-lock the root project and every env (after editing a pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
"${UV[@]}" lock
for d in envs/*/; do (cd "$d" && "${UV[@]}" lock); done
