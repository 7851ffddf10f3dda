"""A framework's own rollout actor, as an RL framework writes one: it makes its own `vllm.LLM`
(naming weightsync's worker extension), generates with its own sampling parameters, and hands
weightsync's calls to a `VllmEngineActor(llm=...)` it holds through one method, `weightsync`
(what `RayEndpoint(handle, name=..., dispatch="weightsync")` calls)."""

from __future__ import annotations

import os
from typing import Any


class FrameworkRollout:
    def __init__(self, model_path: str) -> None:
        from vllm import LLM

        from weightsync.backends.vllm.engine import EXTENSION, VllmEngineActor

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.llm = LLM(
            model=model_path,
            worker_extension_cls=EXTENSION,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
        )
        self.weights = VllmEngineActor(llm=self.llm)

    def weightsync(self, method: str, *args: Any) -> Any:
        return getattr(self.weights, method)(*args)

    def rollout(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy token ids, through the framework's own call of its own engine; refused while
        weightsync writes its weights."""
        self.weights.check_serving()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        return [list(out.outputs[0].token_ids) for out in outs]
