"""An error an engine raises in its actor reaches the caller as a plain error with its message,
though its class exists only in the engine's env (as vLLM's and SGLang's do: Ray would hand the
caller "Failed to deserialize exception", the cause left in the worker logs). Real Ray actors:
the actor's process imports a module the caller's process cannot."""

from __future__ import annotations

import sys

import pytest
import ray

from weightsync.driver import launcher
from weightsync.wire.errors import BucketRejected

QUALNAME = "tests.core.test_actor_errors.EngineInItsEnv"

ENGINE_ONLY = '''
class EngineDeadError(Exception):
    """As an engine's own error: its module exists only where the engine runs."""


class EngineInputError(ValueError):
    pass


def generate():
    raise EngineDeadError("EngineCore encountered an issue. See stack trace for the root cause.")


def bad_input():
    raise EngineInputError("max_tokens must be at least 1, got 0")
'''


class EngineInItsEnv:
    """Its calls run code of a module only its own process can import."""

    def __init__(self, module_dir: str, *, fail_start: bool = False) -> None:
        sys.path.insert(0, module_dir)
        import engine_only

        self.engine = engine_only
        if fail_start:
            engine_only.generate()

    def generate(self) -> None:
        self.engine.generate()

    def bad_input(self) -> None:
        self.engine.bad_input()

    def rejected(self) -> None:
        raise BucketRejected("bucket 3 carries 'w', which refit info did not announce")


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-env")
    (path / "engine_only.py").write_text(ENGINE_ONLY)
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(QUALNAME, "driver")
    yield str(path)
    ray.shutdown()


def test_an_engines_own_error_reaches_the_caller_with_its_class_name_and_message(module_dir):
    assert "engine_only" not in sys.modules and module_dir not in sys.path
    actor = launcher.launch(QUALNAME, module_dir)
    with pytest.raises(RuntimeError) as raised:
        ray.get(actor.generate.remote(), timeout=120)
    text = str(raised.value)
    assert "Failed to deserialize" not in text
    assert (
        "engine_only.EngineDeadError: EngineCore encountered an issue. See stack trace for the "
        "root cause." in text
    )
    assert "raise EngineDeadError" in "".join(raised.value.__notes__)  # where it was raised
    # The caller's bad input still crosses as ValueError, an engine's subclass of it included;
    # weightsync's own errors cross as themselves.
    with pytest.raises(ValueError, match=r"engine_only.EngineInputError: max_tokens must be"):
        ray.get(actor.bad_input.remote(), timeout=120)
    with pytest.raises(BucketRejected, match="which refit info did not announce"):
        ray.get(actor.rejected.remote(), timeout=120)


def test_an_engines_own_error_while_it_starts_reaches_the_first_call(module_dir):
    actor = launcher.launch(QUALNAME, module_dir, fail_start=True)
    with pytest.raises(RuntimeError) as raised:
        ray.get(actor.generate.remote(), timeout=120)
    assert "engine_only.EngineDeadError: EngineCore encountered" in str(raised.value)
    assert any("while it started" in note for note in raised.value.__notes__)
