#!/usr/bin/env bash
# Run the test suites, each inside the environment it needs, building environments first.
#   scripts/test.sh                 every suite
#   scripts/test.sh core sglang     only these (lint, core, envs, sglang, vllm, e2e, reliability)
# `lint` (scripts/lint.sh: ruff format, ruff check, mypy) runs first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

ALL_SUITES=(lint core envs sglang vllm e2e reliability)
suites=("$@")
[ ${#suites[@]} -eq 0 ] && suites=("${ALL_SUITES[@]}")
for s in "${suites[@]}"; do
  case " ${ALL_SUITES[*]} " in *" $s "*) ;; *)
    echo "unknown suite '$s'; valid: ${ALL_SUITES[*]}" >&2; exit 2 ;;
  esac
done

ensure_root_env
# What the machine was busy with, printed after the suites (scripts/load_watch.py).
watch_log=$(mktemp)
"$ROOT_PY" scripts/load_watch.py --every 10 >"$watch_log" 2>&1 &
watch_pid=$!
# Each failed test's reason and the hang reports of its actors (tests/failure_log.py), printed
# last: where a hung call was, in the part of the log that is read.
export WEIGHTSYNC_FAILURE_LOG
WEIGHTSYNC_FAILURE_LOG=$(mktemp)
stop_watch() {
  kill "$watch_pid" 2>/dev/null || true
  wait "$watch_pid" 2>/dev/null || true
  cat "$watch_log"
  rm -f "$watch_log"
  if [ -s "$WEIGHTSYNC_FAILURE_LOG" ]; then
    echo "== failed tests, and where their hung calls were; tests slower than 300 s"
    cat "$WEIGHTSYNC_FAILURE_LOG"
  fi
  rm -f "$WEIGHTSYNC_FAILURE_LOG"
}
trap stop_watch EXIT
status=0
for suite in "${suites[@]}"; do
  if [ "$suite" = lint ]; then
    echo "== suite lint"
    scripts/lint.sh || status=1
    continue
  fi
  [ -d "tests/$suite" ] && ls tests/"$suite"/test_*.py >/dev/null 2>&1 || {
    echo "== suite $suite: no tests yet, skipped"; continue; }
  case "$suite" in
    sglang) env=sglang ;;
    vllm) env=$(vllm_env_name) ;;
    *) env= ;;
  esac
  if [ -n "$env" ]; then
    "$ROOT_PY" -m weightsync env build "$env" --with trainer,test
    py=$("$ROOT_PY" -m weightsync env path "$env")
  else
    py=$ROOT_PY
  fi
  echo "== suite $suite ($py) at $(date +%T)"
  start=$(date +%s)
  "$py" -m pytest "tests/$suite" -q -p no:cacheprovider --durations=12 || status=1
  echo "== suite $suite: $(( $(date +%s) - start )) s"
done
exit $status
