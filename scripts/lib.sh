# Shared by the scripts: find or bootstrap uv, build the root (driver) environment.
# shellcheck shell=bash

if command -v uv >/dev/null 2>&1; then
  UV=(uv)
else
  if ! python3 -m uv --version >/dev/null 2>&1; then
    echo "uv not found: installing it with 'python3 -m pip install uv'" >&2
    python3 -m pip install --quiet uv
  fi
  UV=(python3 -m uv)
fi
export UV_PYTHON_DOWNLOADS=never
ROOT_PY="$PWD/.venv/bin/python"

ensure_root_env() {
  "${UV[@]}" sync --locked --quiet
}

vllm_env_name() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo vllm
  else
    echo vllm-cpu
  fi
}
