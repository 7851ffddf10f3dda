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
# A full run builds two engine envs here and two more for the wheel test (~45 GB with an empty uv
# cache): what the disk has left, printed first, explains a failed extraction later.
df -h . "${TMPDIR:-/tmp}" | sed 's/^/== disk: /'
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
run_suite() {
  local suite=$1 env py start
  if [ "$suite" = lint ]; then
    echo "== suite lint"
    scripts/lint.sh
    return
  fi
  [ -d "tests/$suite" ] && ls tests/"$suite"/test_*.py >/dev/null 2>&1 || {
    echo "== suite $suite: no tests yet, skipped"; return 0; }
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
  local rc=0
  "$py" -m pytest "tests/$suite" -q -p no:cacheprovider --durations=12 || rc=$?
  echo "== suite $suite: $(( $(date +%s) - start )) s"
  return $rc
}

has_suite() { case " ${suites[*]} " in *" $1 "*) return 0 ;; esac; return 1; }

status=0
# `envs` spends most of its time downloading and installing the engine envs, so when `core` runs
# too, envs runs beside lint and core (its log printed when it ends) and the suites that need
# the engine envs start after it.
envs_pid=
envs_log=
if has_suite envs && has_suite core; then
  envs_log=$(mktemp)
  echo "== suite envs runs beside lint and core; its log follows when it ends"
  run_suite envs >"$envs_log" 2>&1 &
  envs_pid=$!
fi
wait_envs() {
  [ -n "$envs_pid" ] || return 0
  wait "$envs_pid" || status=1
  envs_pid=
  cat "$envs_log"
  rm -f "$envs_log"
}
for suite in "${suites[@]}"; do
  if [ "$suite" = envs ] && [ -n "$envs_log" ]; then
    continue
  fi
  case "$suite" in lint | core) ;; *) wait_envs ;; esac
  run_suite "$suite" || status=1
done
wait_envs
exit $status
