"""The stock-engine path (weightsync/engine/stock.py) without an engine: the staged checkpoint
read back by safetensors' own reader, the refit check against the served checkpoint, and a
2-rank FSDP2 `TrainerSync` syncing into a `StockEngine` whose reload reads the staged folder
with safetensors into a torch module (the real engines' reloads: tests/vllm/test_vllm_stock.py,
tests/sglang/test_sglang_stock.py)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.core.test_trainer_sync import _run_two_ranks_of
from weightsync.engine.stock import StagedCheckpoint, StockEngine
from weightsync.wire.specs import TensorSpec


class DiskReloadEngine(StockEngine):
    """A stock engine whose "server" is a torch module that reloads the staged folder with
    safetensors' reader, by parameter name, as an engine's checkpoint loader does."""

    engine_name = "disk"

    def __init__(self, model_path: str, module: torch.nn.Module, staging_dir: str) -> None:
        super().__init__(staging_dir=staging_dir)
        self.model_path = model_path
        self.module = module
        self.fail_reload = False
        self.fail_load = False
        self.reloads: list[str] = []

    def _engine_load(self, descriptor: dict):
        if self.fail_load and self._loaded >= 1:  # the first bucket of the update is staged
            raise RuntimeError("transport failed after a bucket")
        return super()._engine_load(descriptor)

    def _reload(self, folder: str, version: str) -> bool:
        from safetensors.torch import load_file

        self._reloading = True

        params = dict(self.module.named_parameters())
        for name, tensor in load_file(os.path.join(folder, "model.safetensors")).items():
            if name in params:
                params[name].data.copy_(tensor)
            if self.fail_reload:
                raise RuntimeError("reload failed half way")
        self.reloads.append(version)
        return True


def test_the_staged_checkpoint_is_what_safetensors_reads(tmp_path):
    from safetensors import safe_open

    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"")  # not linked: the staged file replaces it
    specs = [
        TensorSpec(name="a.weight", dtype="bfloat16", shape=(3, 5)),
        TensorSpec(name="b.bias", dtype="float32", shape=(7,)),
        TensorSpec(name="c", dtype="int64", shape=(2, 2, 2)),
    ]
    folder = tmp_path / "staged"
    folder.mkdir()
    staged = StagedCheckpoint(str(folder), specs, str(source))
    want = {
        "a.weight": torch.randn(3, 5).to(torch.bfloat16),
        "b.bias": torch.randn(7),
        "c": torch.arange(8).view(2, 2, 2),
    }
    for name, tensor in want.items():
        staged.tensors[name].copy_(tensor)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert os.path.islink(folder / "config.json")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(f.get_tensor(name), tensor), name
    staged.tensors["b.bias"].fill_(2.5)  # written after: the file's bytes change in place
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("b.bias"), torch.full((7,), 2.5))


@pytest.fixture
def checkpoint(tmp_path):
    from weightsync.apps.models import make_tiny_model

    return make_tiny_model(str(tmp_path / "ckpt"), arch="opt", seed=0)


def _specs(path: str) -> list[dict]:
    from weightsync.engine.refit import checkpoint_specs

    return [
        {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}
        for s in checkpoint_specs(path).values()
        if s.name != "lm_head.weight"
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"dtype": "bfloat16"},
            r"trainer dtype bfloat16 != checkpoint dtype float32; send float32",
        ),
        ({"shape": [3, 3]}, r"trainer shape \(3, 3\) != engine shape"),
        ({"name": "model.decoder.nope.weight"}, r"no parameter for trainer tensor 'model.decoder"),
    ],
)
def test_the_refit_check_refuses_what_the_checkpoint_does_not_hold(
    checkpoint, tmp_path, change, message
):
    engine = DiskReloadEngine(checkpoint, torch.nn.Module(), str(tmp_path))
    specs = _specs(checkpoint)
    specs[1] = {**specs[1], **change}
    with pytest.raises(ValueError, match=message):
        engine.check_refit(specs)
    assert engine.staged_folder() is None


def test_a_tied_trainer_into_an_engine_whose_checkpoint_unties_the_head_is_refused(tmp_path):
    """The trainer ties its head (sends only the embedding); the engine's checkpoint has a head
    of its own that no sync would reach (vLLM's refit check, at connect, is this one)."""
    from weightsync.apps.models import make_tiny_model
    from weightsync.engine.refit import check_against_checkpoint, checkpoint_specs

    untied = make_tiny_model(str(tmp_path / "qwen2"), arch="qwen2", seed=0)
    specs = [TensorSpec.from_dict(s) for s in _specs(untied)]
    with pytest.raises(
        ValueError,
        match=r"engine tensor 'lm_head.weight' would get no trainer tensor: the engine's "
        r"checkpoint unties the LM head .*tie_word_embeddings false.*untie the trainer's model",
    ):
        check_against_checkpoint(specs, untied, engine_dtype="float32", name="vllm")
    # Sent, it is taken; a tied checkpoint needs no head from the trainer.
    head = checkpoint_specs(untied)["lm_head.weight"]
    check_against_checkpoint([*specs, head], untied, engine_dtype="float32", name="vllm")
    tied = make_tiny_model(str(tmp_path / "opt"), arch="opt", seed=0)
    tied_specs = [TensorSpec.from_dict(s) for s in _specs(tied)]
    check_against_checkpoint(tied_specs, tied, engine_dtype="float32", name="vllm")


def _stock_rank(rank: int, port: int, results, options: dict) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    # timeout_s: a failed sync leaves rank 1 waiting in a collective until then
    sync = TrainerSync(
        model, options=SyncOptions(bucket_bytes=1 << 16, timeout_s=8.0, verify=False)
    )
    strict = TrainerSync(
        model, options=SyncOptions()
    )  # verifies, the default; every rank makes one
    out: dict = {}
    engine = None
    if rank == 0:
        served = build_model("opt", "tiny", seed=0)
        engine = DiskReloadEngine(options["checkpoint"], served, options["staging"])
        out["connect"] = sync.connect({"disk": LocalEndpoint(engine, name="disk")})
        out["folder"] = engine.staged_folder()
        out["folder_mode"] = os.stat(out["folder"]).st_mode & 0o777
        # A trainer that verifies every sync is refused at connect, naming the engine.
        try:
            strict.connect({"disk": LocalEndpoint(engine, name="disk")})
        except ValueError as exc:
            out["strict_error"] = str(exc)
        engine.check_refit(sync.refit_info())  # the strict trainer's check laid it out again
    else:
        sync.connect({})
    try:
        sync.sync("v0", verify=True)
    except ValueError as exc:
        out["verify_error"] = str(exc)
    out["after_refusal"] = engine.weight_version() if engine else None
    out["report"] = sync.sync("v1")
    try:
        sync.verify()  # every rank takes part in the gathers; rank 0 refuses after them
    except ValueError as exc:
        out["verify_call_error"] = str(exc)
    full = dict(sync.source.tensors())
    if engine is not None:
        params = dict(engine.module.named_parameters())
        out["equal"] = all(torch.equal(params[n], t) for n, t in full.items())
        out["one_copy"] = engine.begin("v2", one_copy=True)
        try:
            engine.fingerprints()
        except RuntimeError as exc:
            out["fingerprints_error"] = str(exc)
        engine.fail_load = True
    try:
        sync.sync("v1-partial")
    except RuntimeError as exc:
        out["failed_load"] = str(exc)
    if engine is not None:
        # Aborted before the reload: the engine still serves v1, its weights untouched.
        engine.check_serving()
        out["after_failed_load"] = engine.weight_version()
        params = dict(engine.module.named_parameters())
        out["still_equal"] = all(torch.equal(params[n], t) for n, t in full.items())
        engine.fail_load, engine.fail_reload = False, True
    try:
        sync.sync("v2")
    except RuntimeError as exc:
        out["failed_reload"] = str(exc)
    if engine is not None:
        out["reloads"] = list(engine.reloads)
        try:
            engine.check_serving()
        except RuntimeError as exc:
            out["serving_error"] = str(exc)
        engine.fail_reload = False
    sync.sync("v3")  # a later sync completes
    if engine is not None:
        engine.check_serving()
        out["after_recovery"] = (engine.weight_version(), list(engine.reloads))
        engine.shutdown()
        out["folder_left"] = os.path.exists(out["folder"])
        results.put(out)
    sync.close()
    strict.close()
    close_trainer_group()


def test_trainer_sync_into_a_stock_engine_stages_reloads_and_refuses_verification(
    checkpoint, tmp_path
):
    out = _run_two_ranks_of(_stock_rank, {"checkpoint": checkpoint, "staging": str(tmp_path)})
    assert out["connect"]["disk"].unverifiable.startswith("disk runs nothing of weightsync's")
    assert out["folder"].startswith(str(tmp_path))
    assert out["folder_mode"] == 0o700  # the staged weights: owner-only
    assert (
        "engine 'disk' cannot be verified and this trainer verifies every sync (verify=True, "
        "the default)" in out["strict_error"]
    )
    assert "make the trainer with SyncOptions(verify=False)" in out["strict_error"]
    assert "sync(verify=True) refused, nothing was written: engine 'disk'" in out["verify_error"]
    assert out["after_refusal"] is None
    assert out["verify_call_error"].startswith("verify refused: engine 'disk': disk runs nothing")
    report = out["report"]
    assert report.path == "buckets" and report.verify is None
    assert report.engines["disk"].weight_version == "v1"
    assert out["equal"]  # the reloaded module holds the trainer's tensors exactly
    assert out["one_copy"] == {
        "one_copy": False,
        "why": "disk: a stock engine has no one-copy path",
    }
    assert "its weights cannot be read back" in out["fingerprints_error"]
    assert "transport failed after a bucket" in out["failed_load"]
    assert out["after_failed_load"] == "v1" and out["still_equal"]
    # A reload that failed half way: the engine refuses to serve until a later sync completes.
    assert "reload failed half way" in out["failed_reload"]
    assert out["reloads"] == ["v1"]
    assert "does not serve: update 'v2' was aborted" in out["serving_error"]
    assert out["after_recovery"] == ("v3", ["v1", "v3"])  # and serves again
    assert not out["folder_left"]


def test_a_stock_server_on_another_host_or_without_its_reload_routes_is_refused(tmp_path):
    """Refused when the actor starts, naming the fix (stand-in HTTP servers, not engines):
    the served checkpoint is not a folder here; vLLM without VLLM_SERVER_DEV_MODE=1."""
    from tests.engine_checks import open_json_server
    from weightsync.backends.sglang.stock import SglStockEngine
    from weightsync.backends.vllm.stock import VllmStockEngine

    elsewhere = {"/health": {}, "/server_info": {"model_path": "/models/on-another-host"}}
    with open_json_server(elsewhere) as url:
        with pytest.raises(ValueError, match="not a folder on this host.*run this actor on the"):
            SglStockEngine(url)
    no_dev_mode = {"/health": {}, "/v1/models": {"data": [{"id": "m", "root": str(tmp_path)}]}}
    with open_json_server(no_dev_mode) as url:
        with pytest.raises(ValueError, match="start it with VLLM_SERVER_DEV_MODE=1"):
            VllmStockEngine(url)
