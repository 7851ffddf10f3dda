"""Runs inside SGLang's scheduler process, as a `custom_weight_loader`.

SGLang calls `weightsync_load(model, named_tensors)` from `update_weights_from_tensor` when the
request's load_format names it. We pass one control item: its name is a JSON message
{"op": "check"|"load"|"finish"|"commit"|"rollback"|"fingerprints"|"share"|"begin_one_copy",
"reply": dir, ...} and its tensor is empty; the weights
themselves are in a transport buffer that the message's descriptor points at. SGLang ignores
what a custom loader returns and an exception kills the scheduler (and with it the caller), so
every outcome, failure included, is written as JSON to `<reply>/<pid>.json` and nothing raises.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from weightsync.wire.specs import error_reply, ok_reply

logger = logging.getLogger(__name__)

_receivers: dict[int, Any] = {}


def _receiver(model: Any) -> Any:
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from weightsync.engine.replica import ModelReceiver

    receiver = _receivers.get(id(model))
    if receiver is None:
        receiver = ModelReceiver(
            model, load_fn=model.load_weights, default_loader=default_weight_loader, name="sglang"
        )
        _receivers[id(model)] = receiver
    return receiver


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


def _run(model: Any, message: dict[str, Any]) -> dict[str, Any]:
    """One control call in one TP scheduler (each gets the same message; `weightsync_load`
    adds the scheduler's `tp_rank` to every reply). The scheduler learns and reports its
    placements (where its loader puts the elements of each tensor it holds, slices at TP > 1;
    weightsync/wire/placement.py), which verification compares against."""
    from weightsync.wire.specs import BucketDescriptor, specs_from_dicts

    receiver = _receiver(model)
    op = message["op"]
    size = _tp()[1]
    if op == "check":
        return receiver.check_refit(specs_from_dicts(message["specs"])).to_dict()
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
        return {"restored": receiver.restore_previous()}
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


LOADER = f"{__name__}.weightsync_load"
