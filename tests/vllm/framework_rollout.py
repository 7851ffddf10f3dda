"""A framework's own rollout actor, as an RL framework writes one: it makes its own `vllm.LLM`
(naming weightsync's worker extension), generates with its own sampling parameters, and hands
weightsync's calls to a `VllmEngineActor(llm=...)` it holds through one method, `weightsync`
(what `RayEndpoint(handle, name=..., dispatch="weightsync")` calls)."""

from __future__ import annotations

import os
import threading
import time
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
        weightsync writes its weights, and one engine call at a time with weightsync's."""
        with self.weights.serving():
            return self._greedy(prompts, max_tokens)

    def _greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        return [list(out.outputs[0].token_ids) for out in outs]

    def sample_beside(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Start sampling in a thread of this actor beside weightsync's calls, as a framework
        that samples while its trainer syncs does: greedy rollouts in a loop, each inside
        `serving()`, recorded with the version served and when (`stop_sampling`)."""
        self._stop = threading.Event()
        self._samples: list[dict[str, Any]] = []

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    with self.weights.serving():
                        start = time.time()
                        version = self.weights.weight_version()
                        tokens = self._greedy(prompts, max_tokens)
                        self._samples.append(
                            {
                                "version": version,
                                "tokens": tokens,
                                "start": start,
                                "end": time.time(),
                            }
                        )
                except Exception as exc:  # refused (an update that is not staged): a record
                    self._samples.append({"error": repr(exc), "start": time.time()})
                    time.sleep(0.05)

        self._sampler = threading.Thread(target=loop, daemon=True, name="framework-sampler")
        self._sampler.start()

    def stop_sampling(self) -> list[dict[str, Any]]:
        """Stop `sample_beside`'s thread: what it sampled, in order."""
        self._stop.set()
        self._sampler.join(timeout=300)
        return self._samples
