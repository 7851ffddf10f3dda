#!/usr/bin/env bash
# The habits CI enforces before the tests: ruff format, ruff check, and mypy (pyproject.toml
# [tool.mypy]: weightsync/ and backends/, mypy's default level) over the root environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_root_env
paths=(weightsync backends tests scripts examples hatch_build.py)
status=0
echo "== ruff format --check"; .venv/bin/ruff format --check "${paths[@]}" || status=1
echo "== ruff check"; .venv/bin/ruff check "${paths[@]}" || status=1
echo "== mypy"; .venv/bin/mypy || status=1
exit $status
