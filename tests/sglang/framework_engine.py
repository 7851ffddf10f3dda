"""A framework's own rollout actor, as an RL framework writes one: it makes its own
`sglang.Engine` (naming weightsync's custom weight loader), generates with its own sampling
parameters, and hands weightsync's calls to an `SglEngineActor(engine=...)` it holds through one
method, `weightsync` (what `RayEndpoint(handle, name=..., dispatch="weightsync")` calls)."""

from __future__ import annotations

from typing import Any


class FrameworkEngine:
    def __init__(self, model_path: str) -> None:
        import sglang

        from weightsync.backends.sglang.engine import CPU_ENGINE_ARGS, SglEngineActor
        from weightsync.backends.sglang.loader import LOADER

        self.engine = sglang.Engine(
            model_path=model_path, dtype="float32", custom_weight_loader=[LOADER], **CPU_ENGINE_ARGS
        )
        self.weights = SglEngineActor(engine=self.engine)

    def weightsync(self, method: str, *args: Any) -> Any:
        return getattr(self.weights, method)(*args)

    def rollout(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy token ids, through the framework's own call of its own engine; refused while
        weightsync writes its weights, and one engine call at a time with weightsync's."""
        with self.weights.serving():
            outs = self.engine.generate(
                input_ids=prompts,
                sampling_params={
                    "max_new_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                return_logprob=True,
            )
        return [[int(p[1]) for p in out["meta_info"]["output_token_logprobs"]] for out in outs]

    def shutdown(self) -> None:
        self.engine.shutdown()
