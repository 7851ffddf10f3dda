"""Tensors an SGLang model derives after loading are kept in step with every sync
(backends/sglang/derived.py), tested in the sglang env on a module whose load derives them with
SGLang's own DeepSeek post-load step (`DeepseekV2WeightLoaderMixin.post_load_weights`, which
writes each MLA layer's `w_kc` / `w_vc` from `kv_b_proj.weight`), driven through weightsync's
SGLang loader (backends/sglang/loader.py `weightsync_load`) as SGLang's scheduler calls it.
SGLang's DeepSeek models need rotary embeddings, which SGLang cannot run on this CPU
(../shared/FINDINGS.md), so no real SGLang engine serves one here (docs/topologies.md)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.deepseek_common.deepseek_weight_loader import (
    DeepseekV2WeightLoaderMixin,
)
from torch import nn

from weightsync.backends.sglang import loader
from weightsync.backends.sglang.derived import PostLoadTensors
from weightsync.transports.shm import ShmSender
from weightsync.wire.bucket import fill_buckets, plan_buckets
from weightsync.wire.specs import BucketDescriptor, TensorSpec, unwrap_all

HEADS, NOPE, V, LORA = 4, 16, 8, 32


class _MLA(nn.Module):
    """What SGLang's DeepSeek MLA attention holds that its post-load step reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_b_proj = nn.Linear(LORA, HEADS * (NOPE + V), bias=False)
        self.o_proj = nn.Linear(HEADS * V, LORA, bias=False)
        self.qk_nope_head_dim, self.v_head_dim = NOPE, V
        self.w_kc: torch.Tensor | None = None
        self.w_vc: torch.Tensor | None = None
        self.w_scale = 1.0
        self.w_kc_qrep = None
        self.use_deep_gemm_bmm = False


class TinyDeepseek(nn.Module, DeepseekV2WeightLoaderMixin):
    """Two MLA layers whose `load_weights` ends as SGLang's DeepSeek loader does: the
    post-load step over the layers it loaded."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(architectures=["DeepseekV2ForCausalLM"], num_hidden_layers=2)
        self.quant_config = None
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.model.layers:
            layer.self_attn = _MLA()
        self.model.start_layer, self.model.end_layer = 0, 2
        self.requires_grad_(False)
        self.loads = 0  # calls of `load_weights`
        self.post_load_weights()  # as the engine's start-up load ends

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        names = []
        for name, tensor in weights:  # each through its parameter's loader, as SGLang's do
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            names.append(name)
        self.loads += 1
        self.post_load_weights(weight_names=names)


def _derivation(attn: _MLA) -> tuple[torch.Tensor, torch.Tensor]:
    """w_kc and w_vc as the layer's kv_b_proj weight gives them, computed here on its own."""
    w = attn.kv_b_proj.weight.view(HEADS, NOPE + V, LORA)
    return w[:, :NOPE, :], w[:, NOPE:, :].transpose(1, 2)


def _in_step(model: TinyDeepseek) -> bool:
    return all(
        torch.equal(layer.self_attn.w_kc, kc) and torch.equal(layer.self_attn.w_vc, vc)
        for layer in model.model.layers
        for kc, vc in [_derivation(layer.self_attn)]
    )


class _Scheduler:
    """weightsync's control calls into one model, as SGLang's scheduler makes them, each
    answered through its reply file."""

    def __init__(self, model: nn.Module, reply_dir: str) -> None:
        self.model, self.reply_dir = model, reply_dir
        self.sender = ShmSender(num_slots=1)

    def call(self, op: str, **fields) -> dict:
        """The reply's result; a failed one raised again as the engine actor raises it."""
        message = json.dumps({"op": op, "reply": self.reply_dir, **fields})
        loader.weightsync_load(self.model, [(message, torch.empty(0))])
        (result,) = unwrap_all(loader.read_replies(self.reply_dir))
        return result

    def load(self, tensors: dict[str, torch.Tensor], **fields) -> None:
        """Every tensor in one bucket, in the same segment each time: described as the sender
        describes it (`same` once the receiver holds its views), so a later bucket replays."""
        pairs = list(tensors.items())
        (plan,) = plan_buckets([TensorSpec.of(n, t) for n, t in pairs], capacity_bytes=1 << 24)
        sender = self.sender
        for filled in fill_buckets([plan], iter(pairs), lambda p: sender.buffer(0, p.nbytes)):
            handle = sender.describe(0, filled.index)
            descriptor = (
                BucketDescriptor(
                    index=filled.index, nbytes=filled.nbytes, tensors=[], handle=handle
                )
                if handle.get("same")
                else filled.descriptor(handle)
            )
            self.call("load", descriptor=descriptor.to_dict(), **fields)

    def sync(self, tensors: dict[str, torch.Tensor]) -> None:
        """One update: its bucket loaded, then committed."""
        self.load(tensors)
        self.call("commit")

    def close(self) -> None:
        self.sender.close()


@pytest.fixture
def scheduler(tmp_path):
    model = TinyDeepseek()
    scheduler = _Scheduler(model, str(tmp_path))
    specs = [TensorSpec.of(n, p).to_dict() for n, p in model.named_parameters()]
    scheduler.call("check", specs=specs)
    yield scheduler
    scheduler.close()


def _trained(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_the_module_derives_its_mla_tensors_from_its_weights():
    model = TinyDeepseek()
    derived = PostLoadTensors(model)
    assert derived.refused == [] and len(derived.layers) == 2
    assert derived.refuse({}) == []
    assert derived.names() == [
        f"model.layers.{i}.self_attn.{a}" for i in range(2) for a in ("w_kc", "w_vc")
    ]
    assert _in_step(model) and derived.stale() == []


def test_a_first_sync_through_the_loader_derives_from_the_synced_weights_not_from_learning(
    scheduler,
):
    # The first bucket goes through the loader and its placements are learned on scratch
    # copies; SGLang's post-load step, run inside those loads, would derive from the scratch.
    model = scheduler.model
    before = model.model.layers[0].self_attn.w_kc.clone()
    scheduler.sync(_trained(model, 1))
    assert model.loads > 1  # the loader ran (the sync's load, the learning loads)
    assert not torch.equal(model.model.layers[0].self_attn.w_kc, before)
    assert _in_step(model)


def test_a_replayed_bucket_skips_the_loader_and_the_derived_tensors_still_follow(scheduler):
    model = scheduler.model
    scheduler.sync(_trained(model, 1))
    scheduler.sync(_trained(model, 2))  # the bucket's views mapped: it replays from the next
    loads = model.loads
    new = _trained(model, 3)
    scheduler.sync(new)
    assert model.loads == loads  # a placed replay: no loader, so SGLang's post-load never ran
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.kv_b_proj.weight, new["model.layers.1.self_attn.kv_b_proj.weight"])
    assert _in_step(model)


def test_a_rolled_back_update_derives_from_the_weights_put_back(scheduler):
    model = scheduler.model
    scheduler.sync(_trained(model, 1))
    kept = model.model.layers[0].self_attn.w_kc.clone()
    scheduler.load(_trained(model, 2), keep_previous=True)
    scheduler.call("stage")  # fingerprints for verification: derived before them
    assert _in_step(model) and not torch.equal(model.model.layers[0].self_attn.w_kc, kept)
    assert scheduler.call("rollback")["restored"] > 0
    assert torch.equal(model.model.layers[0].self_attn.w_kc, kept) and _in_step(model)


def test_a_derived_tensor_left_stale_fails_the_sync_naming_it(scheduler, monkeypatch):
    monkeypatch.setattr(PostLoadTensors, "derive", lambda self: None)  # planted: never derives
    with pytest.raises(
        RuntimeError,
        match=r"sglang: after the update: 4 derived tensor\(s\) differ from what SGLang derives "
        r".*model\.layers\.0\.self_attn\.w_kc.*decode would compute with other weights",
    ):
        scheduler.sync(_trained(scheduler.model, 1))


def test_staged_updates_are_refused_for_a_model_that_derives_tensors(scheduler):
    why = scheduler.call("staged_support")["why"]
    assert why is not None and "derives tensors from its weights after loading" in why
    assert "model.layers.0.self_attn.w_kc" in why and "sync without staged" in why


class _QuantizedDeepseek(TinyDeepseek):
    def __init__(self) -> None:
        super().__init__()
        attn = self.model.layers[1].self_attn
        attn.kv_b_proj.weight = nn.Parameter(
            torch.zeros(attn.kv_b_proj.weight.shape, dtype=torch.int8), requires_grad=False
        )


class _UnknownPostLoad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scaled = self.proj.weight.detach() * 2  # derived, in no form weightsync knows

    def load_weights(self, weights):
        for name, tensor in weights:
            param = dict(self.named_parameters())[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        self.post_load_weights()

    def post_load_weights(self, **_):
        self.scaled.copy_(self.proj.weight.detach() * 2)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_QuantizedDeepseek, r"MLA layer model\.layers\.1\.self_attn: kv_b_proj is quantized"),
        (
            _UnknownPostLoad,
            r"_UnknownPostLoad derives tensors after loading \(`post_load_weights`\) that "
            r"weightsync does not know how to keep in step",
        ),
    ],
)
def test_a_model_whose_derived_tensors_cannot_be_kept_in_step_is_refused_at_check(
    tmp_path, make, why
):
    model = make()
    specs = [TensorSpec.of(n, p).to_dict() for n, p in model.named_parameters()]
    scheduler = _Scheduler(model, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=rf"sglang: 1 layer\(s\) refused: {why}.*another way"):
            scheduler.call("check", specs=specs)
        with pytest.raises(
            ValueError,
            match=r"SyncOptions\(accept_unkept=\{'(mla_up_projections|post_load_unknown)': ",
        ):
            scheduler.call("check", specs=specs)
    finally:
        scheduler.close()


def test_an_accepted_refusal_connects_and_syncs_leave_only_the_refused_layer_as_it_started(
    tmp_path,
):
    """`SyncOptions(accept_unkept={"mla_up_projections": reason})`: the model with a quantized
    kv_b_proj in layer 1 passes the check, the answer naming layer 1 with the reason; a sync
    derives layer 0's w_kc / w_vc from what it wrote (SGLang's own step, which would transform
    layer 1 again, no longer runs) and leaves layer 1's as they were at start-up."""
    model = _QuantizedDeepseek()
    specs = [TensorSpec.of(n, p).to_dict() for n, p in model.named_parameters()]
    scheduler = _Scheduler(model, str(tmp_path))
    try:
        answer = scheduler.call(
            "check", specs=specs, accept={"mla_up_projections": "layer 1 is frozen"}
        )
        (accepted,) = answer["accepted"]
        assert accepted.startswith("MLA layer model.layers.1.self_attn: kv_b_proj is quantized")
        assert accepted.endswith("(accepted: layer 1 is frozen)")
        refused = model.model.layers[1].self_attn
        kept = (refused.w_kc.clone(), refused.w_vc.clone())
        new = {n: t for n, t in _trained(model, 1).items() if "layers.1.self_attn.kv_b" not in n}
        scheduler.sync(new)
        attn = model.model.layers[0].self_attn
        kc, vc = _derivation(attn)
        assert torch.equal(attn.kv_b_proj.weight, new["model.layers.0.self_attn.kv_b_proj.weight"])
        assert torch.equal(attn.w_kc, kc) and torch.equal(attn.w_vc, vc)
        assert torch.equal(refused.w_kc, kept[0]) and torch.equal(refused.w_vc, kept[1])
    finally:
        scheduler.close()
