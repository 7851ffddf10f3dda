"""The one-copy path (weightsync/trainer/one_copy/targets.py): probing where an engine's loader puts each tensor,
parameters moved into shared memory, trainer writes, digests, and the sender's one-copy sync."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.engine.one_copy.segment import SharedParameters, probe_destinations
from weightsync.trainer.endpoint import LocalEndpoint
from weightsync.trainer.one_copy.targets import OneCopyTarget, copy_checked
from weightsync.trainer.sender import WeightSender
from weightsync.transports.shm import SHM_DIR, ShmSender, list_segments
from weightsync.wire.errors import NotShared
from weightsync.wire.specs import TensorSpec


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 300_001])
@pytest.mark.parametrize("start", [0, 3])
def test_copy_checked_copies_every_byte_and_catches_one_that_differs(nbytes, start, monkeypatch):
    import numpy as np

    src = torch.randint(0, 256, (nbytes + start,), dtype=torch.uint8)[start:]
    dst = torch.zeros(nbytes + 5, dtype=torch.uint8)[5:]
    assert copy_checked(dst, src) and torch.equal(dst, src)
    if nbytes >= 8:  # a chunk whose copy lost a bit is reported
        original = np.copyto

        def lossy(d, s):
            original(d, s)
            d[0] ^= 1

        monkeypatch.setattr(np, "copyto", lossy)
        assert not copy_checked(dst, src)
    with pytest.raises(ValueError, match="copy of 4 bytes into 3"):
        copy_checked(torch.zeros(3, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))


def _fused_engine():
    """An engine-like model: q, k and v loaded into one fused parameter along dim 0, "t"
    transposed on the way in, "w" copied as is."""
    params = {
        "qkv": torch.zeros(12, 8, dtype=torch.bfloat16),
        "t": torch.zeros(8, 4, dtype=torch.bfloat16),
        "w": torch.zeros(5, 3, dtype=torch.float32),
    }
    rows = {"q": 0, "k": 4, "v": 8}

    def load_one(name, tensor):
        if name in rows:
            params["qkv"][rows[name] : rows[name] + 4].copy_(tensor)
        elif name == "t_in":
            params["t"].copy_(tensor.t())
        else:
            params["w"].copy_(tensor)

    specs = {n: TensorSpec(name=n, dtype="bfloat16", shape=(4, 8)) for n in ("q", "k", "v")}
    specs["t_in"] = TensorSpec(name="t_in", dtype="bfloat16", shape=(4, 8))
    specs["w"] = TensorSpec(name="w", dtype="float32", shape=(5, 3))
    param_of = {"q": ["qkv"], "k": ["qkv"], "v": ["qkv"], "t_in": ["t"], "w": ["w"]}
    return params, specs, param_of, load_one


def test_probe_finds_verbatim_destinations_and_leaves_the_parameters_as_they_were():
    params, specs, param_of, load_one = _fused_engine()
    for p in params.values():
        p.copy_(torch.randn(p.shape))
    before = {n: p.clone() for n, p in params.items()}
    found = probe_destinations(params, param_of, specs, load_one)
    row_bytes = 8 * 2
    assert found == {
        "q": ("qkv", 0),
        "k": ("qkv", 4 * row_bytes),
        "v": ("qkv", 8 * row_bytes),
        "w": ("w", 0),
    }  # "t_in" is transposed on the way in: not verbatim
    for name, p in params.items():
        assert torch.equal(p, before[name])


def _counted(put, calls):
    """(load_one, load_many) loaders that `put` each tensor, counting their calls in `calls`."""

    def load_one(name, tensor):
        calls["one"] += 1
        put(name, tensor)

    def load_many(pairs):
        calls["many"] += 1
        for name, tensor in pairs:
            put(name, tensor)

    return load_one, load_many


def test_the_tensors_of_a_fused_parameter_are_probed_together_in_one_load():
    """64 experts loaded into one fused parameter in a shuffled order, plus a tied pair (two
    tensors into the same place): the experts are not where the group probe guesses (back to
    back in order), so they are found by one batched load of their parameter alone (no probe
    per tensor), the tied pair one at a time, and the parameters are left as they were."""
    experts, rows = 64, 3
    params = {
        "w": torch.randn(experts * rows, 4).to(torch.bfloat16),
        "emb": torch.randn(6, 4),
    }
    slot = torch.randperm(experts, generator=torch.Generator().manual_seed(1)).tolist()
    names = [f"e{i}" for i in range(experts)]
    calls = {"one": 0, "many": 0}

    def put(name, tensor):
        if name in ("embed", "head"):
            params["emb"].copy_(tensor)
        else:
            i = slot[int(name[1:])]
            params["w"][i * rows : (i + 1) * rows].copy_(tensor)

    load_one, load_many = _counted(put, calls)
    specs = {n: TensorSpec(name=n, dtype="bfloat16", shape=(rows, 4)) for n in names}
    specs |= {n: TensorSpec(name=n, dtype="float32", shape=(6, 4)) for n in ("embed", "head")}
    param_of = {n: ["w"] for n in names} | {"embed": ["emb"], "head": ["emb"]}
    before = {n: p.clone() for n, p in params.items()}
    found = probe_destinations(params, param_of, specs, load_one, load_many)
    assert found == {n: ("w", slot[i] * rows * 4 * 2) for i, n in enumerate(names)} | {
        "embed": ("emb", 0),
        "head": ("emb", 0),
    }
    # The group's load (the experts; the tied pair does not fit its parameter), one batched
    # load a parameter; the tied pair: one of them overwrote the other, which was then probed
    # alone (and the one found in the batch is not probed again).
    assert calls == {"one": 1, "many": 3}, calls
    for name, p in params.items():
        assert torch.equal(p, before[name])


@pytest.mark.parametrize("cols", [4, 3])  # 24-byte experts (one copy checks them), 18-byte
def test_experts_loaded_in_order_after_a_header_are_found_in_one_batched_load(cols):
    """Experts loaded back to back, in order, after 4 elements of something else: not where the
    group probe guesses, so the parameter's own batched probe places every one (where 8-byte
    sizes let it check them with one copy, and piece by piece otherwise) and puts the
    parameter back."""
    experts, rows, head = 16, 3, 4
    params = {"w": torch.randn(head + experts * rows * cols).to(torch.bfloat16)}
    names = [f"e{i}" for i in range(experts)]
    calls = {"one": 0, "many": 0}

    def put(name, tensor):
        at = head + int(name[1:]) * rows * cols
        params["w"][at : at + rows * cols].copy_(tensor.reshape(-1))

    load_one, load_many = _counted(put, calls)
    specs = {n: TensorSpec(name=n, dtype="bfloat16", shape=(rows, cols)) for n in names}
    before = params["w"].clone()
    found = probe_destinations(params, {n: ["w"] for n in names}, specs, load_one, load_many)
    assert found == {n: ("w", 2 * (head + i * rows * cols)) for i, n in enumerate(names)}
    # The group's load, then the parameter's; 18-byte experts guessed at 8-byte aligned places
    # would overrun the parameter: no group is tried.
    assert calls == {"one": 0, "many": 2 if cols == 4 else 1}, calls
    assert torch.equal(params["w"], before)


def _many_params(count: int):
    """`count` parameters of one tensor each (sizes 3 to 40 elements: some not a multiple of 8
    bytes, one of 2 bytes), a fused q/k/v loaded back to back in order, "conv" that the loader
    converts (bf16 in, float32 kept: not verbatim) and "flag" whose loader also writes a byte
    of another parameter's (an engine's "loaded" mark): random values everywhere."""
    gen = torch.Generator().manual_seed(3)
    params = {f"p{i}": torch.randn(1 + (i * 7) % 40, generator=gen) for i in range(count)}
    params = {n: p.to(torch.bfloat16) for n, p in params.items()}
    params["qkv"] = torch.randn(12, 8, generator=gen).to(torch.bfloat16)
    params["conv"] = torch.randn(6, generator=gen)
    params["flag"] = torch.randn(8, generator=gen).to(torch.bfloat16)
    specs = {
        n: TensorSpec(name=n, dtype="bfloat16", shape=tuple(p.shape)) for n, p in params.items()
    }
    del specs["qkv"]
    specs |= {n: TensorSpec(name=n, dtype="bfloat16", shape=(4, 8)) for n in ("q", "k", "v")}
    param_of = {n: [n] for n in specs} | {n: ["qkv"] for n in ("q", "k", "v")}
    rows = {"q": 0, "k": 4, "v": 8}

    def put(name, tensor):
        if name in rows:
            params["qkv"][rows[name] : rows[name] + 4].copy_(tensor)
        else:
            params[name].copy_(tensor)  # "conv": bf16 converted into float32
        if name == "flag":
            params["flag"][0] = 1.0

    return params, specs, param_of, put


def test_many_parameters_are_placed_by_one_load_and_those_the_loader_changes_are_left_out():
    """Hundreds of parameters probed in one load of all their tensors: each tensor placed at
    its byte offset (q, k, v back to back in their fused parameter); the converted tensor and
    the one whose loader writes an extra byte are left out after a probe of their own; every
    parameter is left as it was, byte for byte."""
    params, specs, param_of, put = _many_params(300)
    calls = {"one": 0, "many": 0}
    load_one, load_many = _counted(put, calls)
    before = {n: p.clone() for n, p in params.items()}
    found = probe_destinations(params, param_of, specs, load_one, load_many)
    expected = {n: (n, 0) for n in params if n.startswith("p")}
    expected |= {"q": ("qkv", 0), "k": ("qkv", 64), "v": ("qkv", 128)}
    assert found == expected
    # One load for the group; "conv" and "flag" alone: each one tensor, so one at a time.
    assert calls == {"one": 2, "many": 1}, calls
    for name, p in params.items():
        assert torch.equal(p.view(torch.uint8), before[name].view(torch.uint8)), name


def test_a_group_budget_splits_the_probe_into_loads_of_at_most_that_many_bytes(monkeypatch):
    from weightsync.engine.one_copy import segment

    params, specs, param_of, put = _many_params(300)
    calls = {"one": 0, "many": 0}
    load_one, load_many = _counted(put, calls)
    monkeypatch.setitem(segment.GROUP_BYTES, "cpu", 1024)
    sizes = []
    found = probe_destinations(
        params,
        param_of,
        specs,
        load_one,
        lambda pairs: [sizes.append(len(pairs)), load_many(pairs)],
    )
    assert len(found) == 303
    assert calls["many"] == len(sizes) > 10, calls  # each load at most 1024 bytes of parameters
    assert sum(sizes) == 303 + 2  # every tensor once, "conv" and "flag" in their groups


def test_a_loader_that_fails_during_a_group_probe_leaves_every_parameter_as_it_was():
    params, specs, param_of, put = _many_params(50)
    before = {n: p.clone() for n, p in params.items()}

    def load_many(pairs):
        for name, tensor in pairs:
            put(name, tensor)
            if name == "p30":
                raise RuntimeError("loader failed")

    with pytest.raises(RuntimeError, match="loader failed"):
        probe_destinations(params, param_of, specs, lambda n, t: put(n, t), load_many)
    for name, p in params.items():
        assert torch.equal(p.view(torch.uint8), before[name].view(torch.uint8)), name


def test_a_loader_that_writes_beyond_its_tensor_is_probed_one_at_a_time_and_left_out():
    """A loader that also writes a byte outside the tensor's place (a pad, a flag): the batched
    probe does not place it, nor does the one-at-a-time probe; the parameter is put back."""
    params = {"w": torch.zeros(8, 4)}

    def load_one(name, tensor):
        i = int(name[1:])
        params["w"][2 * i : 2 * i + 2].copy_(tensor)
        if name == "e3":
            params["w"][0, 0] = 7.0

    specs = {f"e{i}": TensorSpec(name=f"e{i}", dtype="float32", shape=(2, 4)) for i in range(4)}
    param_of = {n: ["w"] for n in specs}
    found = probe_destinations(params, param_of, specs, load_one)
    assert found == {f"e{i}": ("w", i * 32) for i in range(3)}
    assert torch.equal(params["w"], torch.zeros(8, 4))


def test_shared_parameters_take_trainer_writes_and_notice_when_moved():
    params, specs, param_of, load_one = _fused_engine()
    destinations = probe_destinations(params, param_of, specs, load_one)
    shared = SharedParameters(params, destinations)
    target = OneCopyTarget(shared.describe())  # as a trainer rank maps it
    try:
        assert shared.segment.name in list_segments()
        mode = os.stat(os.path.join(SHM_DIR, shared.segment.name)).st_mode
        assert stat.S_IMODE(mode) == 0o600  # owner-only
        k = torch.randn(4, 8).to(torch.bfloat16)
        first, second = k[:2].contiguous(), k[2:].contiguous()
        assert target.write("k", 0, first, check=True)  # one rank's half, read back ...
        assert target.write("k", 2 * 16, second)  # ... and the other's
        assert torch.equal(params["qkv"][4:8], k)  # the engine's own parameter changed
        assert shared.moved() == []
        # What is registered in each place now: a view at the same address but transposed,
        # and a parameter no longer registered, are both moved.
        now = list(shared.params.values())
        assert shared.moved([p.t() if n == "w" else p for n, p in zip(shared.params, now)]) == ["w"]
        assert shared.moved([None if n == "qkv" else p for n, p in zip(shared.params, now)]) == [
            "qkv"
        ]
        params["w"].data = torch.zeros(5, 3)  # something replaced a parameter's storage
        assert shared.moved() == ["w"]
        with pytest.raises(NotShared, match=r"no longer live in shared segment .*'w'"):
            shared.check()
    finally:
        target.close()
        shared.close()
    assert shared.segment.name not in list_segments()


def test_trainer_refuses_shared_parameters_others_may_read():
    params, specs, param_of, load_one = _fused_engine()
    shared = SharedParameters(params, probe_destinations(params, param_of, specs, load_one))
    try:
        os.chmod(os.path.join(SHM_DIR, shared.segment.name), 0o640)
        with pytest.raises(
            RuntimeError,
            match=rf"segment '{SHM_DIR}/{shared.segment.name}' has "
            rf"owner uid {os.geteuid()}, mode 0o640; "
            rf"weightsync maps only .* own uid",
        ):
            OneCopyTarget(shared.describe())
    finally:
        shared.close()


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(64, 32).to(torch.bfloat16), requires_grad=False)
    model.b = torch.nn.Parameter(torch.randn(33), requires_grad=False)
    return model


def test_one_copy_sync_after_a_sync_by_buckets_is_verified_and_a_bad_read_back_aborts_it():
    trainer = dict(_module(1).named_parameters())
    receiver = ModuleWeightReceiver(_module(2), name="mod")
    specs = [TensorSpec.of(n, t) for n, t in trainer.items()]
    sender = WeightSender(specs, transport=ShmSender(), capacity_bytes=1 << 20)
    sender.add_engine(LocalEndpoint(receiver, name="mod"))
    targets: dict[str, OneCopyTarget] = {}
    try:
        assert sender.sync(iter(trainer.items()), version="v1", verify=True).verify["mod"].verified
        shared = receiver.share_params()["shared"]
        targets["mod"] = OneCopyTarget(shared)
        for t in trainer.values():
            t.add_(1)

        def write(one_copy, fallback, corrupt=""):
            assert one_copy == ["mod"] and fallback == []
            pieces, bad = 0, []
            for name, t in trainer.items():
                raw = t.reshape(-1).view(torch.uint8)
                half = raw.numel() // 2  # two "ranks", the second at an odd offset for "b"
                for offset, part in ((0, raw[:half]), (half, raw[half:])):
                    if (
                        not targets["mod"].write(name, offset, part, check=True) or name == corrupt
                    ):  # as a rank reports bytes that read back wrong
                        bad.append(name)
                    pieces += 1
            return {"pieces": pieces, "mismatched": bad}

        report, fallback = sender.sync_one_copy(write, version="v2", engines=["mod"], verify=True)
        assert fallback == [] and report.engines["mod"].path == "one_copy"
        assert report.verify["mod"].verified, report.verify
        got = dict(receiver.receiver.model.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in trainer.items())
        assert receiver.weight_version() == "v2"
        with pytest.raises(RuntimeError, match=r"update 'v3' aborted: .*\{'mod': \['b'\]\}"):
            sender.sync_one_copy(
                lambda d, f: write(d, f, corrupt="b"), version="v3", engines=["mod"], verify=True
            )
        assert receiver.weight_version() == "v2"  # the bad update was never adopted
        # A parameter moved while the trainer wrote: the engine's `end` fails the update,
        # verified or not.

        def write_while_moving(one_copy, fallback):
            got["b"].data = got["b"].data.clone()
            return write(one_copy, fallback)

        with pytest.raises(NotShared, match=r"no longer live in shared segment .*\['b'\]"):
            sender.sync_one_copy(write_while_moving, version="v3b", engines=["mod"])
        assert receiver.weight_version() == "v2"
        # Parameters moved elsewhere: the engine is handed back to buckets, nothing written.
        calls = []
        report, fallback = sender.sync_one_copy(
            lambda d, f: calls.append((d, f)), version="v4", engines=["mod"]
        )
        assert report is None and fallback == ["mod"] and calls == [([], ["mod"])]
        assert receiver.weight_version() == "v2"
        again = receiver.share_params()["shared"]
        assert again["segment"] != shared["segment"]  # shared anew
        # A trainer that still holds the old sharing mapped (the engine was shared again, for
        # another trainer or after its parameters moved) is sent to buckets, nothing written;
        # one that names the current sharing writes.
        calls.clear()
        report, fallback = sender.sync_one_copy(
            lambda d, f: calls.append((d, f)),
            version="v5",
            engines=["mod"],
            sharing={"mod": [shared["segment"]]},
        )
        assert report is None and fallback == ["mod"] and calls == [([], ["mod"])]
        why = receiver.receiver.begin_one_copy(keep_previous=False, sharing=[shared["segment"]])
        assert shared["segment"] in why and again["segment"] in why and "buckets" in why
        targets["mod"].close()
        targets["mod"] = OneCopyTarget(again)
        report, fallback = sender.sync_one_copy(
            write, version="v6", engines=["mod"], sharing={"mod": [again["segment"]]}, verify=True
        )
        assert fallback == [] and report.verify["mod"].verified
        assert receiver.weight_version() == "v6"
    finally:
        for target in targets.values():
            target.close()
        receiver.receiver.close()
        sender.close()


def test_trainer_takes_only_engines_its_ranks_can_write_into():
    """What an engine shared against the ranks' transport and GPUs (weightsync/trainer/one_copy/path.py): a
    CPU segment only over shm, CUDA storages only over cuda_ipc and only when every rank's
    shards are on the engine's GPU (copies between GPUs are not offered); a tensor-parallel
    engine is refused as a whole when one worker is out of reach."""
    from weightsync.trainer.one_copy.path import unreachable

    segment = {"segment": "ws-x", "nbytes": 8, "offsets": {}}

    def cuda(gpu):
        return {"cuda": {"owner": "o", "storages": [], "uuid": gpu}, "offsets": {}}

    assert unreachable(segment, "shm", []) is None
    assert "GPU engines only" in unreachable(segment, "cuda_ipc", ["GPU-a"])
    assert "CPU engines only" in unreachable(cuda("GPU-a"), "shm", [])
    assert unreachable(cuda("GPU-a"), "cuda_ipc", ["GPU-a", "GPU-a"]) is None
    why = unreachable(cuda("GPU-a"), "cuda_ipc", ["GPU-a", "GPU-b"])
    assert "within one GPU only" in why and "GPU-b" in why
    assert "within one GPU only" in unreachable(cuda("GPU-a"), "cuda_ipc", [None])
    assert unreachable([cuda("GPU-a"), cuda("GPU-b")], "cuda_ipc", ["GPU-a"]) is not None


def test_a_shared_parameter_replaced_by_a_new_object_is_noticed():
    """An engine that registers a new Parameter object (its own storage) where a shared one was
    computes with the new one, though the old still lives in the shared memory: a replacement
    while the trainer writes fails the update at `end`; the next `begin` hands that sync back
    to buckets. The engine keeps its version either way."""
    trainer = dict(_module(1).named_parameters())
    receiver = ModuleWeightReceiver(_module(2), name="mod")
    model = receiver.receiver.model
    specs = [TensorSpec.of(n, t) for n, t in trainer.items()]
    sender = WeightSender(specs, transport=ShmSender(), capacity_bytes=1 << 20)
    sender.add_engine(LocalEndpoint(receiver, name="mod"))
    try:
        sender.sync(iter(trainer.items()), version="v1")
        assert receiver.share_params()["shared"]

        def replace_while_writing(one_copy, fallback):
            assert one_copy == ["mod"]
            model.b = torch.nn.Parameter(model.b.detach().clone())  # same values, new memory
            return {}

        with pytest.raises(NotShared, match=r"no longer live in shared segment .*\['b'\]"):
            sender.sync_one_copy(replace_while_writing, version="v2", engines=["mod"])
        assert receiver.weight_version() == "v1"
        calls = []
        report, fallback = sender.sync_one_copy(
            lambda d, f: calls.append((d, f)), version="v3", engines=["mod"]
        )
        assert report is None and fallback == ["mod"] and calls == [([], ["mod"])]
        assert receiver.weight_version() == "v1"
    finally:
        receiver.receiver.close()
        sender.close()


def test_a_new_update_closes_a_one_copy_begin_other_workers_refused():
    """A worker that accepted a one-copy begin (keeping its previous weights) while another
    worker of its engine refused writes nothing: the next update's opening closes it, so a
    rollback of that next update does not fence the parameters off (they stay shared)."""
    specs = [TensorSpec.of(n, t) for n, t in _module(1).named_parameters()]
    receiver = ModuleWeightReceiver(_module(2), name="mod")
    try:
        receiver.check_refit([s.to_dict() for s in specs])
        shared = receiver.share_params()["shared"]
        assert receiver.receiver.begin_one_copy(keep_previous=True) is None
        receiver.receiver.open_update()  # the engine's next update, by buckets
        receiver.receiver.restore_previous()  # that update rolled back
        assert receiver.receiver.sharing.shared is not None
        assert (
            receiver.receiver.begin_one_copy(keep_previous=False, sharing=[shared["segment"]])
            is None
        )
        receiver.receiver.end_one_copy()
    finally:
        receiver.receiver.close()


def test_a_receiver_that_learned_whole_placements_shares_without_running_its_loader_again():
    """A receiver that learned where its loader puts every tensor while loading (whole, in
    order) shares its parameters with no probe load: the same offsets as a receiver that
    learned nothing and probes."""
    from weightsync.apps.layouts import build_module

    experts = 16
    shapes = [("w13", (experts * 4, 6)), ("norm", (6,))]
    where = {f"e{i}": ("w13", i * 24) for i in range(experts)}
    specs = [TensorSpec(name=n, dtype="bfloat16", shape=(4, 6)) for n in where]
    specs.append(TensorSpec(name="norm", dtype="bfloat16", shape=(6,)))
    tensors = [(s.name, torch.randn(s.shape).to(torch.bfloat16)) for s in specs]
    answers, loads = [], []
    for learned in (True, False):
        receiver = ModuleWeightReceiver(build_module(shapes, fill=True), fused=where, sliced=True)
        receiver.check_refit([spec.to_dict() for spec in specs])
        if learned:
            receiver.receiver.learn_placements(tensors)
        count = []
        inner = receiver.receiver.load_fn
        receiver.receiver.sharing.load_fn = lambda pairs, c=count, f=inner: [c.append(1), f(pairs)]
        try:
            answers.append(receiver.receiver.share().shared["offsets"])
        finally:
            receiver.receiver.close()
        loads.append(len(count))
    assert answers[0] == answers[1]
    assert [answers[0][n] - answers[0]["e0"] for n in where] == [48 * i for i in range(experts)]
    assert loads[0] == 0 and loads[1] >= 1, loads
