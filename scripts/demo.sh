#!/usr/bin/env bash
# The main job: train a tiny model and keep SGLang and vLLM in step (see `weightsync demo -h`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_root_env
exec "$ROOT_PY" -m weightsync demo "$@"
