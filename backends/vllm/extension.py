"""Runs inside vLLM's worker processes, as `worker_extension_cls`.

Why this and not vLLM's weight-transfer factory: the factory's engines are created inside
`Worker.load_model`, so registering ours needs a plugin entry point, and its default
`update_weights` synchronises a CUDA device, which a CPU worker lacks. A worker extension is one
class on the worker, called through `collective_rpc` with plain data; that is all we need.

Loading goes through vLLM's layerwise reload (initialize -> load_weights per bucket -> finalize):
on CPU, vLLM prepacks Linear weights for its GEMM kernels after loading and drops the original
parameter, so a plain `load_weights` on the live model fails half-way. We also keep those
parameters (vLLM's `remove_weight` off) so the engine's weights can be fingerprinted afterwards.
Layerwise reload holds on to incoming tensors until their layer is complete, so each bucket is
copied out of the transport buffer before loading (one extra memcpy on this path).
Every method returns {"ok": ..., "result"|"error"} instead of raising: vLLM turns a worker
exception into a bare Exception and loses its type.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _keep_cpu_linear_weights() -> None:
    from vllm.model_executor.layers import linear, utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_weightsync", False):
        return

    def dispatch(layer: Any, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    dispatch._weightsync = True
    linear.dispatch_cpu_unquantized_gemm = dispatch
    utils.dispatch_cpu_unquantized_gemm = dispatch


_keep_cpu_linear_weights()


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(self: Any, *args: Any) -> dict[str, Any]:
        from weightsync.wire import error_reply, ok_reply

        try:
            return ok_reply(fn(self, *args))
        except BaseException as exc:  # noqa: BLE001 - see module doc
            return error_reply(exc)

    wrapped.__name__ = fn.__name__
    return wrapped


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker class; method names carry a prefix to avoid vLLM's own."""

    def _ws_state(self) -> dict[str, Any]:
        state = getattr(self, "_weightsync", None)
        if state is None:
            from weightsync.receiver import ModelReceiver, copy_loader

            model = self.model_runner.model
            state = self._weightsync = {
                "receiver": ModelReceiver(model, load_fn=model.load_weights,
                                          default_loader=copy_loader, name="vllm"),
                "open": False,
            }
        return state

    @_guard
    def weightsync_check(self, specs: list[dict]) -> dict[str, Any]:
        from weightsync.receiver import check_against_checkpoint
        from weightsync.wire import dtype_to_str, specs_from_dicts

        config = self.vllm_config.model_config
        receiver = self._ws_state()["receiver"]
        parsed = specs_from_dicts(specs)
        check_against_checkpoint(parsed, config.model, engine_dtype=dtype_to_str(config.dtype),
                                 name="vllm")
        receiver.accepted = {s.name: s for s in parsed}
        return {"param_of": receiver.param_of, "num_params": len(receiver.accepted)}

    @_guard
    def weightsync_begin(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        state = self._ws_state()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(state["receiver"].model)
        state["open"] = True

    @_guard
    def weightsync_load(self, descriptor: dict) -> dict[str, Any]:
        import torch
        from vllm.config import set_current_vllm_config

        from weightsync.wire import BucketDescriptor

        state = self._ws_state()
        if not state["open"]:
            raise RuntimeError("vllm: load outside an update; begin first")
        receiver = state["receiver"]
        start = time.perf_counter()
        bucket = BucketDescriptor.from_dict(descriptor)
        # Layerwise reload keeps the tensors it is given until their whole layer has arrived,
        # which may be after the sender reused this buffer: hand it copies.
        views = [(n, t.clone()) for n, t in receiver.receive(bucket)]
        model = receiver.model
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            known = [(n, t) for n, t in views if n in receiver.param_of]
            if known:
                model.load_weights(known)
            # First sight of a tensor: load it alone to learn which parameters it lands in.
            for name, tensor in views:
                if name not in receiver.param_of:
                    receiver.param_of[name] = sorted(model.load_weights([(name, tensor)]))
        del views, known
        receiver.release(bucket)
        return {"num_tensors": len(bucket.tensors), "nbytes": bucket.nbytes,
                "seconds": time.perf_counter() - start}

    @_guard
    def weightsync_end(self) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        state = self._ws_state()
        model = state["receiver"].model
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            # On CPU an embedding that doubles as the tied LM head keeps a prepacked copy for
            # the logits GEMM, which layerwise reload does not refresh: rebuild it.
            for module in model.modules():
                if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                    module.quant_method.process_weights_after_loading(module)
        state["open"] = False
        return {"param_of": state["receiver"].param_of}

    @_guard
    def weightsync_fingerprints(self) -> dict[str, list[int]]:
        receiver = self._ws_state()["receiver"]
        prints = receiver.fingerprints()
        empty = [n for n, p in receiver.model.named_parameters() if n in prints and p.numel() == 0]
        if empty:
            raise RuntimeError(f"vllm: parameters {empty[:3]} hold no weights (prepacked "
                               f"by vLLM); cannot fingerprint them")
        return prints
