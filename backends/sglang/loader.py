"""Runs inside SGLang's scheduler process, as a `custom_weight_loader`.

SGLang calls `weightsync_load(model, named_tensors)` from `update_weights_from_tensor` when the
request's load_format names it. We pass one control item: its name is a JSON message
{"op": "check"|"load"|"finish"|"commit"|"rollback"|"fingerprints"|"share"|"begin_one_copy"|
"staged_support"|"begin_staged"|"stage"|"prepare"|"switch"|"discard"|"release_staged", "reply": dir,
...} and
its tensor is empty; the weights themselves are in a transport buffer that the message's
descriptor points at. SGLang ignores what a custom loader returns and an exception kills the
scheduler (and with it the caller), so every outcome, failure included, is written as JSON to
`<reply>/<pid>.json` and nothing raises.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Any

from weightsync.wire.specs import error_reply, ok_reply

logger = logging.getLogger(__name__)

_receivers: dict[int, Any] = {}
_post_loads: dict[int, Any] = {}  # per model: PostLoadTensors (backends/sglang/derived.py)
_derived_state: dict[int, dict[str, Any]] = {}  # per model: {"pending": derive before serving}
_staged: dict[int, dict[str, Any]] = {}  # per model: {"weights": StagedWeights, "open", "written"}


def _receiver(model: Any) -> Any:
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from weightsync.engine.replica import ModelReceiver

    receiver = _receivers.get(id(model))
    if receiver is None:
        post_load = _post_load(model)

        def load_fn(weights: Any) -> Any:
            # The model's post-load step waits for the end of the update (`_derive`): run by
            # each load, it would derive from scratch copies while placements are learned.
            with post_load.held():
                return model.load_weights(weights)

        receiver = ModelReceiver(
            model,
            load_fn=load_fn,
            default_loader=default_weight_loader,
            name="sglang",
            placed_replays=True,
        )
        _receivers[id(model)] = receiver
    return receiver


def _post_load(model: Any) -> Any:
    post_load = _post_loads.get(id(model))
    if post_load is None:
        from weightsync.backends.sglang.derived import PostLoadTensors

        post_load = _post_loads[id(model)] = PostLoadTensors(model)
    return post_load


def _refuse_derived(model: Any, accept: dict[str, str] | None) -> list[str]:
    """A model whose derived tensors cannot be kept in step is refused at `check` (connect),
    unless `accept` (`SyncOptions.accept_unkept`) names the kind: the accepted ones."""
    return _post_load(model).refuse(accept or {})


def _derive(model: Any, state: dict[str, Any]) -> None:
    """Inside an update that wrote the served parameters, once, before the engine is verified,
    probed or serves: what the model derives after loading derived from what the update wrote,
    then checked (a failure fails the sync, verified or not)."""
    if state.get("pending"):
        post_load = _post_load(model)
        post_load.derive()
        post_load.check("after the update")
        state["pending"] = False


def _tp() -> tuple[int, int]:
    """(this scheduler's tensor-parallel rank, the TP size); (0, 1) where SGLang set up none."""
    try:
        from sglang.srt.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError, AttributeError):
        return 0, 1


def staged_support(model: Any) -> str | None:
    """Why this scheduler cannot stage an update (weightsync/engine/staging.py), or None. A
    staged copy holds the parameters as the model serves them, and the loaders write it as
    they write the parameters: layers whose weights SGLang transforms after loading (quantized
    layers, CPU AMX packing, MoE backends that re-lay their experts) would be written in the
    checkpoint's layout over a transformed one, and tensors derived from the parameters after
    loading (MLA's w_kc / w_vc) would stay those of the served weights."""
    from weightsync.backends.sglang.derived import post_load_platform

    platform = post_load_platform()
    if platform is not None:
        return (
            f"sglang: on {platform} SGLang transforms the weights after loading, which a staged "
            f"copy cannot hold; sync without staged"
        )
    post_load = _post_load(model)
    if post_load.layers or post_load.refused:
        return (
            f"sglang: {type(model).__name__} derives tensors from its weights after loading "
            f"({', '.join(post_load.names()[:2]) or 'post_load_weights'}), which a staged copy "
            f"of the parameters does not hold; sync without staged"
        )
    for name, module in model.named_modules():
        if getattr(module, "use_intel_amx_backend", False):
            return (
                f"sglang: layer {name!r} computes from AMX-packed weights, which a staged copy "
                f"cannot hold; stage without AMX (SGLANG_CPU_AMX off) or sync without staged"
            )
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            return (
                f"sglang: layer {name!r} runs {type(method).__name__}, which transforms its "
                f"weights after loading; staged updates take unquantized models only"
            )
        if getattr(method, "use_flashinfer_trtllm_moe", False):
            return (
                f"sglang: layer {name!r} re-lays its experts for flashinfer's TRT-LLM MoE after "
                f"loading; staged updates need another MoE backend"
            )
    return None


def _staging(model: Any) -> dict[str, Any]:
    state = _staged.get(id(model))
    if state is None:
        from weightsync.engine.staging import StagedWeights

        state = {
            "weights": StagedWeights(model, name="sglang"),
            "open": False,
            "written": set(),
            "swap": False,  # the switch swaps the served parameters with the copy
            "revertible": None,  # what the last swapping switch wrote, until another update
        }
        _staged[id(model)] = state
    return state


def _written_otherwise(model: Any) -> None:
    """The served parameters are written outside a staged update: the staged copy no longer
    equals them, and a staged update left open is dropped."""
    state = _staged.get(id(model))
    if state is not None:
        state["weights"].stale()
        state["open"], state["written"], state["revertible"] = False, set(), None


def _run_staged(model: Any, receiver: Any, op: str, message: dict[str, Any]) -> dict[str, Any]:
    """The ops of a staged update: the model serves its parameters meanwhile; each load and
    check points them at the staged copy for its length (`StagedWeights.loading`), between two
    of the scheduler's forward steps."""
    import time

    import torch

    from weightsync.wire.specs import BucketDescriptor

    state = _staging(model)
    weights = state["weights"]
    if op == "revert":
        return _revert(state, receiver)
    if op == "begin_staged":
        why = staged_support(model)
        if why is not None:
            return {"why": why}
        receiver.open_update()
        if state["open"]:  # an earlier staged update was never switched nor dropped
            weights.stale()
        if not weights.current:
            weights.refresh()
        state["open"], state["written"] = True, set()
        state["swap"], state["revertible"] = bool(message.get("swap")), None
        return {"why": None, "staged_bytes": weights.nbytes}
    if op == "discard":  # the served parameters were never written
        weights.stale()
        state["open"], state["written"], state["revertible"] = False, set(), None
        return {}
    if not state["open"]:
        raise RuntimeError(f"sglang: staged {op} outside a staged update; begin first")
    if op == "load":
        with weights.loading(), torch.no_grad():
            report, written = receiver.load_bucket(
                BucketDescriptor.from_dict(message["descriptor"])
            )
        state["written"].update(written)
        return report.to_dict()
    if op == "stage":
        with weights.loading():
            answer = {"fingerprints": receiver.fingerprints(), "placements": receiver.placements}
        weights.prepare(state["written"], swap=state["swap"])  # the switch's copies, ahead
        return answer
    if op == "prepare":  # the switch's copies, before its pause (`stage` makes them too)
        return {"prepare_s": weights.prepare(state["written"], swap=state["swap"])}
    if op == "switch":
        state["open"] = False  # a switch that fails midway leaves no update to go on with
        copy_s = weights.switch(state["written"], swap=state["swap"])
        state["revertible"] = set(state["written"]) if state["swap"] else None
        return {
            "switched_at": time.time(),
            "copy_s": copy_s,
            "staged_bytes": weights.nbytes,
            "placements": receiver.placements,
        }
    raise ValueError(f"unknown weightsync staged op {op!r}")


def _revert(state: dict[str, Any], receiver: Any) -> dict[str, Any]:
    """After a staged update switched with `swap` (the actor's `keep_previous`) and before any
    other update: the served parameters it wrote take their previous values back, in place
    (swapped with the copy again), between two of the scheduler's forward steps. The copy then
    holds the reverted weights: the next staged update makes it again from the served ones."""
    import time

    names = state["revertible"]
    if not names:
        raise RuntimeError(
            "sglang: nothing to revert: the last update was not a staged one switched with "
            "keep_previous=True, or another update or a revert came after it"
        )
    copy_s = state["weights"].switch(names, swap=True)
    state["revertible"] = None
    state["weights"].stale()
    return {
        "switched_at": time.time(),
        "copy_s": copy_s,
        "staged_bytes": state["weights"].nbytes,
        "placements": receiver.placements,
    }


def _run(model: Any, message: dict[str, Any]) -> dict[str, Any]:
    """One control call in one TP scheduler (each gets the same message; `weightsync_load`
    adds the scheduler's `tp_rank` to every reply). The scheduler learns and reports its
    placements (where its loader puts the elements of each tensor it holds, slices at TP > 1;
    weightsync/wire/placement.py), which verification compares against."""
    from weightsync.wire.specs import BucketDescriptor, specs_from_dicts

    receiver = _receiver(model)
    op = message["op"]
    size = _tp()[1]
    if op == "staged_support":
        return {"why": staged_support(model)}
    if op == "release_staged":  # the copy dropped; the next staged update makes it again
        state = _staged.get(id(model))
        if state is not None and state["open"]:
            raise RuntimeError("sglang: a staged update is open; release its copy once it ends")
        state = _staged.pop(id(model), None)
        return {"released": state["weights"].nbytes if state is not None else 0}
    if message.get("staged") or op in ("begin_staged", "discard", "switch", "revert"):
        return _run_staged(model, receiver, op, message)
    derived = _derived_state.setdefault(id(model), {})
    if op in ("load", "begin_one_copy", "share", "rollback"):
        _written_otherwise(model)  # these write the served parameters
        derived["pending"] = True
    elif op in ("stage", "finish", "commit"):
        _derive(model, derived)  # before fingerprints, a probe or serving
    if op == "check":
        accepted = _refuse_derived(model, message.get("accept"))
        answer = receiver.check_refit(specs_from_dicts(message["specs"]))
        return replace(answer, accepted=accepted or None).to_dict()
    if op == "load":
        report, _ = receiver.load_bucket(
            BucketDescriptor.from_dict(message["descriptor"]),
            keep_previous=bool(message.get("keep_previous")),
        )
        return report.to_dict()
    if op == "share":
        return receiver.share(receiver.placements if size > 1 else None).to_dict()
    if op == "begin_one_copy":
        return {
            "why": receiver.begin_one_copy(
                keep_previous=bool(message.get("keep_previous")), sharing=message.get("sharing")
            )
        }
    if op == "finish":  # the staged weights made live for a probe, the previous still kept
        if message.get("one_copy"):
            receiver.end_one_copy()
        return {}
    if op == "commit":
        if message.get("one_copy"):
            receiver.end_one_copy()
        receiver.drop_previous()
        return {"placements": receiver.placements}
    if op == "rollback":
        restored = receiver.restore_previous()
        _derive(model, derived)  # from the weights put back
        return {"restored": restored}
    if op == "fingerprints":
        return {"fingerprints": receiver.fingerprints()}
    if op == "stage":
        return {"fingerprints": receiver.fingerprints(), "placements": receiver.placements}
    raise ValueError(f"unknown weightsync op {op!r}")


def weightsync_load(model: Any, named_tensors: list) -> None:
    reply_dir = None
    try:
        message = json.loads(named_tensors[0][0])
        reply_dir = message["reply"]
        reply = ok_reply({**_run(model, message), "tp_rank": _tp()[0]})
    except BaseException as exc:  # noqa: BLE001 - an escaping exception kills the engine
        reply = error_reply(exc)
    if reply_dir is None:
        logger.error("weightsync control message unreadable: %s", reply)
        return
    path = os.path.join(reply_dir, f"{os.getpid()}.json")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(reply, f)
    os.replace(tmp, path)


def read_replies(reply_dir: str) -> list[dict[str, Any]]:
    """Every scheduler's reply to the last control message (`weightsync_load` wrote them), in
    file-name order."""
    out = []
    for name in sorted(os.listdir(reply_dir)):
        if name.endswith(".json"):
            with open(os.path.join(reply_dir, name)) as f:
                out.append(json.load(f))
    return out


LOADER = f"{__name__}.weightsync_load"
