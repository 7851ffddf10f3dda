"""A trainer rank's write plan (weightsync/trainer/one_copy/writer.py): the copies it replays every sync put
the model's current bytes where a piece-by-piece write puts them, converted to the engines'
dtype, and the plan notices when a parameter was replaced or moved to other storage."""

from __future__ import annotations

import pytest
import torch

from weightsync.engine.one_copy.segment import SharedParameters, probe_destinations
from weightsync.trainer.one_copy.targets import CheckedCopiesCPU, OneCopyTarget
from weightsync.trainer.one_copy.writer import WritePlan
from weightsync.trainer.source import DTensorV2Source, ShardPieces
from weightsync.wire.specs import TensorSpec, dtype_to_str


def _trainer() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.inner = torch.nn.Module()
    model.inner.a = torch.nn.Parameter(torch.randn(16, 8))  # float32: sent as bfloat16
    model.b = torch.nn.Parameter(torch.randn(33))
    model.inner.register_buffer("c", torch.randn(3, 5))
    return model


def _engine(source: DTensorV2Source, device: str = "cpu"):
    """An engine whose loader fuses "inner.a" and "b" into one parameter, "inner.c" alone
    (shared as a segment on the CPU, as CUDA storages on a GPU)."""
    params = {
        "ab": torch.zeros(16 * 8 + 33, dtype=torch.bfloat16, device=device),
        "c": torch.zeros(3, 5, dtype=torch.bfloat16, device=device),
    }
    where = {"inner.a": ("ab", 0), "b": ("ab", 16 * 8), "inner.c": ("c", 0)}

    def load_one(name, tensor):
        pname, start = where[name]
        flat = params[pname].view(-1)
        flat[start : start + tensor.numel()].copy_(tensor.reshape(-1))

    specs = {s.name: s for s in source.specs()}
    param_of = {name: [pname] for name, (pname, _) in where.items()}
    destinations = probe_destinations(params, param_of, specs, load_one)
    if device == "cuda":
        from weightsync.engine.one_copy.cuda_exports import CudaParameters

        return params, CudaParameters(params, destinations)
    return params, SharedParameters(params, destinations)


def _engine_holds(params: dict[str, torch.Tensor], source: DTensorV2Source) -> bool:
    full = dict(source.tensors())
    ab = torch.cat([full["inner.a"].reshape(-1), full["b"]])
    return torch.equal(params["ab"], ab) and torch.equal(params["c"], full["inner.c"])


def test_a_write_plan_copies_current_bytes_and_notices_replaced_parameters():
    model = _trainer()
    source = DTensorV2Source(model, dtype="bfloat16")
    assert {s.name: s.dtype for s in source.specs()} == {
        "inner.a": dtype_to_str(torch.bfloat16),
        "b": "bfloat16",
        "inner.c": "bfloat16",
    }
    params, shared = _engine(source)
    target = OneCopyTarget(shared.describe())
    try:
        with torch.no_grad():
            plan = WritePlan.build(ShardPieces(source, rank=0), [target])
            assert plan is not None and plan.each_sync == [] and plan.count == 3
            assert plan.write() == (3, set()) and _engine_holds(params, source)
            assert target.written == 2 * (16 * 8 + 33 + 15)
            # A training step changes the values in place: same plan, the new bytes.
            model.inner.a.mul_(-2)
            model.inner.c.add_(1)
            assert plan.holds([target])
            plan.write()
            assert _engine_holds(params, source)
            # Replaced storage (`.data =`) and a replaced parameter object: the plan no longer
            # holds; a new one writes what the model now is.
            model.b.data = torch.randn(33)
            assert not plan.holds([target])
            plan = WritePlan.build(ShardPieces(source, rank=0), [target])
            model.inner.a = torch.nn.Parameter(torch.randn(16, 8))
            assert not plan.holds([target])
            plan = WritePlan.build(ShardPieces(source, rank=0), [target])
            assert plan.holds([target]) and not plan.holds([])
            plan.write()
            assert _engine_holds(params, source)
    finally:
        target.close()
        shared.close()


def test_a_state_dict_that_renames_its_entries_is_not_planned():
    model = _trainer()
    model._register_state_dict_hook(
        lambda module, state, prefix, local: {f"x.{k}": v for k, v in state.items()}
    )
    source = DTensorV2Source(model)
    spec = TensorSpec(name="x.b", dtype="float32", shape=(33,))
    assert spec in source.specs()
    assert WritePlan.build(ShardPieces(source, rank=0), []) is None


class _OneRank:
    """The sync group of a trainer with one rank (nothing to exchange)."""

    rank = 0

    @staticmethod
    def gather(obj):
        return [obj]


_CUDA = pytest.mark.gpu


@pytest.mark.parametrize(
    "device,verify",
    [
        ("cpu", False),
        ("cpu", True),
        pytest.param("cuda", False, marks=_CUDA),
        pytest.param("cuda", True, marks=_CUDA),
    ],
)
def test_a_writer_copies_first_and_writes_again_when_the_plan_no_longer_holds(
    device, verify, monkeypatch
):
    """After the first planned write the writer issues the plan's copies before checking it
    (on a GPU the check runs under the copies; verified writes there issue the plan's
    copy-and-read-back kernels the same way, on the CPU its batches read back in cache): a model whose parameter was replaced since gets
    its stale copy overwritten by a new plan's before the write returns, and its bytes are
    counted once. (On the GPU the engine's CUDA storages are handed to the writer in-process:
    a process cannot open its own CUDA IPC exports.)"""
    from weightsync.engine.one_copy import cuda_exports
    from weightsync.trainer.one_copy.writer import OneCopyWriter

    if device == "cuda":
        storages: dict[int, torch.UntypedStorage] = {}

        def export(storage):
            storages[storage.data_ptr()] = storage
            return {"device": storage.device.index or 0, "key": storage.data_ptr()}

        def open_storage(exported, device=None):
            return torch.empty(0, dtype=torch.uint8, device="cuda").set_(storages[exported["key"]])

        monkeypatch.setattr(cuda_exports, "export_storage", export)
        monkeypatch.setattr("weightsync.transports.cuda_ipc.open_storage", open_storage)
    model = _trainer().to(device)
    source = DTensorV2Source(model, dtype="bfloat16")
    params, shared = _engine(source, device=device)
    writer = OneCopyWriter(source, _OneRank())
    msg = {"one_copy": ["e"], "new": {"e": shared.describe()}}
    nbytes = 2 * (16 * 8 + 33 + 15)
    done = {"pieces": 3, "mismatched": [], "bytes": nbytes}
    try:
        assert writer.write(msg, verify=verify) == done
        first = writer.plan
        assert first.checks  # verified writes go through the plan on both
        again = {"one_copy": ["e"], "new": {}}
        with torch.no_grad():
            model.inner.a.mul_(-2)
        assert writer.write(again, verify=verify) == done
        assert writer.plan is first and _engine_holds(params, source)
        issued = []
        plan_type = type(first)
        real_launch = plan_type.launch
        monkeypatch.setattr(
            plan_type,
            "launch",
            lambda plan, **kw: issued.append((plan, kw)) or real_launch(plan, **kw),
        )
        model.b.data = torch.randn(33, device=device)  # new storage: the plan's "b" is stale
        assert writer.write(again, verify=verify) == done
        # copied (and, verifying, read back) first, then planned anew and written (and, verifying,
        # read back) again
        assert writer.plan is not first
        assert issued == [(first, {"verify": verify}), (writer.plan, {"verify": verify})]
        monkeypatch.setattr(plan_type, "launch", real_launch)
        assert _engine_holds(params, source)
        model.inner.a = torch.nn.Parameter(torch.randn(16, 8, device=device))  # a new object
        assert writer.write(again, verify=verify) == done
        assert _engine_holds(params, source)
    finally:
        writer.close()
        shared.close()


def test_checked_cpu_copies_copy_every_pair_and_name_exactly_those_that_read_back_wrong(
    monkeypatch,
):
    """A verified one-copy write on the CPU (`CheckedCopiesCPU`): pairs batched by up to
    BATCH_BYTES (one larger than a batch alone), a strided destination and a dtype changed on
    the way copied alone; every byte lands, and a copy that lost a bit is named by its index,
    in a batch or alone, and no other is."""
    monkeypatch.setattr(CheckedCopiesCPU, "BATCH_BYTES", 4096)
    gen = torch.Generator().manual_seed(0)
    segment = torch.zeros(1 << 16, dtype=torch.uint8)
    pairs, at = [], 0
    for numel in [10, 300, 1, 2000, 64, 9]:  # float32: 2000 elements are 8000 bytes
        src = torch.randn(numel, generator=gen)
        pairs.append((segment[at : at + 4 * numel].view(torch.float32), src))
        at += 4 * numel
    strided = segment[at : at + 4 * 64].view(torch.float32).view(8, 8).t()
    pairs.append((strided, torch.randn(8, 8, generator=gen)))
    at += 4 * 64
    pairs.append((segment[at : at + 2 * 50].view(torch.bfloat16), torch.randn(50, generator=gen)))
    checked = CheckedCopiesCPU(pairs)
    assert len(checked.alone) == 2 and sum(len(b[0]) for b in checked.batches) == 6
    assert len(checked.batches) >= 3  # 4 KiB batches: the 8000-byte copy is one of its own
    checked.launch()
    assert checked.differing() == []
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype))
    # Lose a bit in pair 1 (inside a batch of several) and in pair 6 (copied alone).
    original_foreach, original_copy = torch._foreach_copy_, torch.Tensor.copy_

    def lossy_foreach(dsts, srcs):
        original_foreach(dsts, srcs)
        for d in dsts:
            if d.data_ptr() == pairs[1][0].data_ptr():
                d.view(torch.uint8)[5] ^= 1

    def lossy_copy(self, src, *args, **kwargs):
        out = original_copy(self, src, *args, **kwargs)
        if self.data_ptr() == pairs[6][0].data_ptr():
            self[(0,) * self.dim()] += 1
        return out

    monkeypatch.setattr(torch, "_foreach_copy_", lossy_foreach)
    monkeypatch.setattr(torch.Tensor, "copy_", lossy_copy)
    checked.launch()
    assert checked.differing() == [1, 6]


@pytest.mark.parametrize("start", [0, 3])
def test_bytes_compared_as_words_catch_a_change_in_any_byte(start):
    from weightsync.trainer.one_copy.targets import _same_bytes

    for n in [1, 7, 8, 9, 16, 21]:
        a = torch.randint(0, 256, (n + start,), dtype=torch.uint8)[start:]
        b = torch.zeros(n + 8, dtype=torch.uint8)[8 - start : 8 - start + n]
        b.copy_(a)
        assert _same_bytes(a, b)
        for i in range(n):
            b[i] ^= 4
            assert not _same_bytes(a, b), (n, i)
            b[i] ^= 4
