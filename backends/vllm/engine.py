"""The vLLM engine actor: a real vLLM `LLM` (V1 engine) that generates and receives weights.

The receiving side runs inside vLLM's workers (backends/vllm/extension.py), reached through
`LLM.collective_rpc` with plain data; the bytes travel through the core's transport. On a CPU
machine vLLM needs `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache); the actor sets 1 unless given.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from weightsync.receiver import WeightReceiver
from weightsync.wire import as_plain

logger = logging.getLogger(__name__)

EXTENSION = "backends.vllm.extension.WeightsyncWorkerExtension"


class VllmEngineActor(WeightReceiver):
    """A Ray actor (env "vllm"/"vllm-cpu") holding one vLLM engine. Order: see WeightReceiver."""

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len: int = 256,
                 engine_args: dict[str, Any] | None = None) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.llm = LLM(model=model_path, dtype=dtype, enforce_eager=True,
                       max_model_len=max_model_len, worker_extension_cls=EXTENSION,
                       **(engine_args or {}))
        self._version: str | None = None
        self._open: str | None = None
        self._broken: str | None = None

    def _rpc(self, method: str, *args: Any) -> Any:
        replies = self.llm.collective_rpc(method, args=args)
        for reply in replies:
            if not reply["ok"]:
                error_type = {"ValueError": ValueError, "TypeError": TypeError}.get(
                    reply["type"], RuntimeError)
                raise error_type(reply["error"])
        return replies[0]["result"]

    # ---- WeightReceiver --------------------------------------------------------------------
    def check_refit(self, specs: list[dict]) -> dict:
        return as_plain(self._rpc("weightsync_check", specs))

    def begin(self, version: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"vllm: update {self._open!r} is still open")
        self._rpc("weightsync_begin")
        self._open = version
        self._begin_t = time.perf_counter()

    def load_bucket(self, descriptor: dict) -> dict:
        if self._open is None:
            raise RuntimeError("vllm: load_bucket outside an update; call begin first")
        return as_plain(self._rpc("weightsync_load", descriptor))

    def end(self, version: str) -> dict:
        if self._open != version:
            raise RuntimeError(f"vllm: end({version!r}) but the open update is {self._open!r}")
        start = time.perf_counter()
        result = self._rpc("weightsync_end")
        self._open = None
        self._broken = None
        flushed = bool(self.llm.reset_prefix_cache())
        if hasattr(self.llm, "update_weight_version"):
            self.llm.update_weight_version(version)
        self._version = version
        return as_plain({"weight_version": version, "cache_flushed": flushed,
                         "end_s": time.perf_counter() - start,
                         "session_s": time.perf_counter() - self._begin_t,
                         "param_of": result["param_of"]})

    def abort(self, reason: str) -> None:
        # vLLM's layerwise reload cannot be rolled back: an aborted update leaves layers
        # without weights, so the engine refuses to serve until a sync completes.
        if self._open is not None:
            self._broken = f"update {self._open!r} was aborted ({reason}); sync again"
            logger.error("vllm: %s", self._broken)
        self._open = None

    def fingerprints(self) -> dict[str, list[int]]:
        return self._rpc("weightsync_fingerprints")

    def weight_version(self) -> str | None:
        return self._version

    # ---- serving -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int = 8) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._broken:
            raise RuntimeError(f"vllm engine does not serve: {self._broken}")
        if self._open:
            raise RuntimeError(f"vllm engine does not serve during update {self._open!r}")
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=1,
                                ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            ids = list(out.outputs[0].token_ids)
            tokens.append(ids)
            logprobs.append([float(step[t].logprob) for step, t in
                             zip(out.outputs[0].logprobs, ids)])
        return {"tokens": tokens, "logprobs": logprobs, "weight_version": self._version}

    def shutdown(self) -> None:
        del self.llm
