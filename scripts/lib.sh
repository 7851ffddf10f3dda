# Shared by the scripts: find or bootstrap uv, build the root (driver) environment.
# shellcheck shell=bash

if command -v uv >/dev/null 2>&1; then
  UV=(uv)
elif [ -x .uv-bootstrap/bin/uv ]; then
  UV=(.uv-bootstrap/bin/uv)
else
  # uv into a private venv of the checkout (.uv-bootstrap/, git-ignored), never into the system
  # Python: systems that protect theirs (PEP 668) refuse a plain `pip install`.
  echo "uv not found: installing it into .uv-bootstrap/ (python3 -m venv, then pip install uv)" >&2
  python3 -m venv .uv-bootstrap
  .uv-bootstrap/bin/python -m pip install --quiet uv
  UV=(.uv-bootstrap/bin/uv)
fi
export UV_PYTHON_DOWNLOADS=never
ROOT_PY="$PWD/.venv/bin/python"

ensure_root_env() {
  # --compile-bytecode: every Ray actor and trainer rank imports torch from the .pyc files
  # instead of compiling it again where PYTHONDONTWRITEBYTECODE is set.
  "${UV[@]}" sync --locked --quiet --compile-bytecode
}

vllm_env_name() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo vllm
  else
    echo vllm-cpu
  fi
}
