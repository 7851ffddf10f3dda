"""`python -m weightsync.backends.sglang.serve <sglang.launch_server flags>`: SGLang's HTTP server
with its API key taken from the environment (`WEIGHTSYNC_SGLANG_API_KEY`), not the command line,
which every local user can read in /proc. Otherwise what `python -m sglang.launch_server` does."""

from __future__ import annotations

import os
import sys

KEY_VARIABLE = "WEIGHTSYNC_SGLANG_API_KEY"


def server_argv(argv: list[str], key: str | None) -> list[str]:
    """SGLang's arguments with the API key; `--api-key=KEY` in one word, since a key that starts
    with "-" (token_urlsafe makes one about once in 64) would read as an option."""
    return argv + ([f"--api-key={key}"] if key else [])


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    key = os.environ.pop(KEY_VARIABLE, None)
    load_plugins()
    server_args = prepare_server_args(server_argv(argv, key))
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
