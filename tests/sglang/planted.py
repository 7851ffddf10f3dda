"""Loader faults planted in a real SGLang engine's own weight loaders, for the probe tests.

SGLang runs a `custom_weight_loader` named in an update request inside each scheduler process;
this module is one (`PLANT`), next to weightsync's. `plant_load` wraps the `weight_loader` of one
parameter of layer 0 of the scheduler's model, so that from the next sync the engine loads that
tensor wrong, consistently: the placements weightsync learns from the loader follow the fault,
and fingerprints agree with it. Every call also gives weightsync's loader a fresh receiver
(weightsync learns how each tensor is loaded once, on first sight), as in an engine started
afresh, which the trainer connects under a new name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from tests.sglang.framework_engine import FrameworkEngine

KINDS = ("qk_swapped", "transposed", "dropped")  # OPT has no gate/up projection
PLANT = f"{__name__}.plant_load"
_originals: dict[str, Any] = {}


def _param(model: Any, suffix: str) -> Any:
    for name, param in model.named_parameters():
        if name.endswith(f"layers.0.{suffix}"):
            return param
    raise KeyError(suffix)


def _plant(model: Any, kind: str) -> None:
    for suffix, original in _originals.items():  # SGLang's own loaders back first
        _param(model, suffix).weight_loader = original
    _originals.clear()
    if kind == "none":
        return
    suffix = {
        "qk_swapped": "self_attn.qkv_proj.weight",
        "transposed": "self_attn.out_proj.weight",
        "dropped": "fc2.weight",
    }[kind]
    param = _param(model, suffix)
    original = _originals[suffix] = param.weight_loader
    if kind == "qk_swapped":  # OPT: as many k heads as q heads, so the shards trade places

        def qk_swapped(p: Any, loaded: Any, shard_id: Any = None) -> None:
            original(p, loaded, {"q": "k", "k": "q"}.get(shard_id, shard_id))

        param.weight_loader = qk_swapped
    elif kind == "transposed":
        param.weight_loader = lambda p, loaded, *a: original(p, loaded.t().contiguous(), *a)
    else:
        param.weight_loader = lambda p, loaded, *a: None


def plant_load(model: Any, named_tensors: list) -> None:
    """SGLang's custom-loader call: the first item's name is {"kind", "reply"} as JSON. Never
    raises (an exception would kill the scheduler): the outcome is the reply file."""
    message = json.loads(named_tensors[0][0])
    try:
        _plant(model, message["kind"])
        from weightsync.backends.sglang import loader

        loader._receivers.pop(id(model), None)
        reply = {"planted": message["kind"]}
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(message["reply"], f"{os.getpid()}.json"), "w") as f:
        json.dump(reply, f)


SLOW_SWITCH = f"{__name__}.plant_slow_switch"


def _plant_partway(staging: Any) -> None:
    """The next switch's second batch of copies (the served parameters written from the
    staged copy, weightsync/engine/staging.py `_Swaps`) raises after it ran."""
    real = staging._issue
    calls: list[int] = []

    def failing(batches: Any) -> None:
        real(batches)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("planted: this scheduler's switch failed partway")

    staging._planted_real = real
    staging._issue = failing


def plant_slow_switch(model: Any, named_tensors: list) -> None:
    """SGLang's custom-loader call, {"seconds", "marker", "fail", "reply"} as JSON: from now on
    each staged switch in this scheduler first creates the file `marker` and sleeps `seconds`,
    then switches as before; with `fail` "before" it raises before it copies anything, with
    "midway" after switching half of the parameters, with "partway" (seconds ignored) the
    next switch's own copying raises after writing the parameters (seconds 0 and no `fail`:
    as before).
    Never raises; the reply file says."""
    import time

    from weightsync.backends.sglang import loader

    message = json.loads(named_tensors[0][0])
    try:
        from weightsync.engine import staging

        weights = loader._staging(model)["weights"]
        weights.__dict__.pop("switch", None)  # the class's own switch back
        real_issue = staging.__dict__.pop("_planted_real", None)
        if real_issue is not None:
            staging._issue = real_issue  # the module's own copies back
        seconds, marker = float(message["seconds"]), str(message["marker"])
        fail = message.get("fail") or None
        if fail == "partway":
            _plant_partway(staging)
        elif seconds > 0 or fail:
            switch = weights.switch

            def slow_switch(names: set[str], *args: Any, **kwargs: Any) -> float:
                open(marker, "w").close()
                time.sleep(seconds)
                if fail == "midway":
                    switch(set(sorted(names)[: len(names) // 2]), *args, **kwargs)
                if fail:
                    raise RuntimeError(f"planted: this scheduler's switch failed {fail}")
                return switch(names, *args, **kwargs)

            weights.switch = slow_switch
        reply: dict[str, Any] = {"planted": seconds, "fail": fail}
    except BaseException as exc:  # noqa: BLE001 - an exception would kill the scheduler
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(message["reply"], f"{os.getpid()}.json"), "w") as f:
        json.dump(reply, f)


class PlantedEngine(FrameworkEngine):
    """A framework's own rollout actor (tests/sglang/framework_engine.py: its `weightsync` and
    `rollout`) over an `sglang.Engine` that keeps its previous weights during updates and runs
    this module's loader too, so the test can plant faults in its loaders."""

    def __init__(self, model_path: str) -> None:
        import sglang

        from weightsync.backends.sglang.engine import CPU_ENGINE_ARGS, SglEngineActor
        from weightsync.backends.sglang.loader import LOADER

        self.engine = sglang.Engine(
            model_path=model_path,
            dtype="float32",
            custom_weight_loader=[LOADER, PLANT],
            **CPU_ENGINE_ARGS,
        )
        self.weights = SglEngineActor(engine=self.engine, keep_previous=True)

    def plant(self, kind: str) -> list[dict]:
        """Plant `kind` ("none": SGLang's own loaders) in every scheduler."""
        import torch

        reply = tempfile.mkdtemp(prefix="weightsync-plant-")
        message = json.dumps({"kind": kind, "reply": reply})
        self.engine.begin_weight_update()
        try:
            self.engine.update_weights_from_tensor(
                [(message, torch.empty(0))], load_format=PLANT, flush_cache=False
            )
        finally:
            self.engine.end_weight_update()
        try:
            return [json.load(open(os.path.join(reply, n))) for n in sorted(os.listdir(reply))]
        finally:
            shutil.rmtree(reply, ignore_errors=True)

    def unplant(self) -> list[dict]:
        """SGLang's own loaders back, and a fresh receiver."""
        return self.plant("none")
