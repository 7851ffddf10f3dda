"""`StagedWeights` (weightsync/engine/staging.py): loads land in the staged copy while the
served parameters stay as they were; `switch` writes what was staged into the served
parameters in place."""

from __future__ import annotations

import pytest
import torch

from weightsync.engine.staging import StagedWeights


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_loads_land_in_the_staged_copy_and_switch_writes_them_in_place():
    model = _model()
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    x = torch.randn(5, 4)
    before = model(x)
    staging = StagedWeights(model)
    staging.refresh()
    assert staging.nbytes == sum(p.numel() * 4 for p in model.parameters())
    with staging.loading(), torch.no_grad():
        model[0].weight.fill_(1.0)  # as an engine's loader writes a parameter
        model[1].bias.copy_(torch.tensor([5.0, 6.0]))
        staged_out = model(x)
    assert torch.equal(model(x), before)  # the served weights did not change
    for name, param in model.named_parameters():
        assert torch.equal(param, served[name]) and param.data_ptr() == pointers[name]
    staging.switch({"0.weight", "1.bias"})
    assert torch.equal(model(x), staged_out)
    assert torch.equal(model[0].weight, torch.ones(3, 4))
    assert torch.equal(model[0].bias, served["0.bias"])
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    assert staging.current


def test_a_swapping_switch_keeps_the_previous_weights_and_a_second_one_puts_them_back():
    """`switch(..., swap=)` (a staged update under `keep_previous`): the served parameters take
    the staged values in place and the copy the values they held, so switching the same names
    again serves the previous weights; the copy is not current after either."""
    model = _model()
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    x = torch.randn(5, 4)
    before = model(x)
    staging = StagedWeights(model)
    staging.refresh()
    with staging.loading(), torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].weight.fill_(-2.0)
        staged_out = model(x)

    names = {"0.weight", "1.weight"}
    staging.switch(names, swap=True)
    assert torch.equal(model(x), staged_out) and not staging.current
    with staging.loading():
        assert torch.equal(model[0].weight, served["0.weight"])  # the copy: the previous ones
        assert torch.equal(model[1].bias, served["1.bias"])  # not switched: as it was
    staging.switch(names, swap=True)
    assert torch.equal(model(x), before) and not staging.current
    for name, param in model.named_parameters():
        assert torch.equal(param, served[name]) and param.data_ptr() == pointers[name]


def test_packed_parameters_switch_through_their_functions_and_moved_ones_are_followed():
    """Parameters in `Packed` go through its write and read (here a layout that negates), the
    others in batches; a served parameter given new memory after a switch (as one moved into
    shared memory) is written where it lives now at the next switch, swapping or not."""
    from weightsync.engine.staging import Packed

    model = _model()
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    staging = StagedWeights(model)
    staging.refresh()
    packed = Packed(
        {"1.weight"},
        write=lambda name, param, copy: param.copy_(-copy),
        read=lambda name, into, param: into.copy_(-param),
    )
    with staging.loading(), torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    names = {n for n, _ in model.named_parameters()}
    staging.switch(names, swap=True, packed=packed)
    assert torch.equal(model[1].weight, -(served["1.weight"] + 1))
    assert torch.equal(model[0].weight, served["0.weight"] + 1)
    staging.switch(names, swap=True, packed=packed)  # back: the packed one read through `read`
    assert torch.equal(model[1].weight, served["1.weight"])
    assert torch.equal(model[0].weight, served["0.weight"])
    moved = model[0].weight.data.clone()
    model[0].weight.data = moved  # new memory, the same Parameter
    staging.refresh()
    with staging.loading(), torch.no_grad():
        model[0].weight.fill_(7.0)
    staging.switch({"0.weight"})
    assert model[0].weight.data_ptr() == moved.data_ptr() and torch.equal(
        moved, torch.full((3, 4), 7.0)
    )
    model[0].weight.data = model[0].weight.data.clone()
    with staging.loading(), torch.no_grad():
        model[0].weight.fill_(8.0)
    staging.switch({"0.weight"})
    assert torch.equal(model[0].weight, torch.full((3, 4), 8.0))


def test_a_switch_that_fails_partway_leaves_the_copy_stale_and_the_next_update_whole():
    """A packed parameter's write raising after the plain ones switched: the switch raises,
    the copy is stale, and the next staged update (copy made again from the served weights,
    then written) switches every parameter to its values."""
    from weightsync.engine.staging import Packed

    def failing(name: str, param: torch.Tensor, copy: torch.Tensor) -> None:
        raise RuntimeError("planted: the packed write failed")

    model = _model()
    staging = StagedWeights(model)
    staging.refresh()
    with staging.loading(), torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0)
    names = {n for n, _ in model.named_parameters()}
    broken = Packed({"1.weight"}, write=failing, read=lambda name, into, param: None)
    with pytest.raises(RuntimeError, match="planted"):
        staging.switch(names, packed=broken)
    assert torch.equal(model[0].weight, torch.ones(3, 4))  # switched before the failure
    assert not torch.equal(model[1].weight, torch.ones(2, 3))  # not switched
    assert not staging.current
    staging.refresh()  # the next staged update, writing part of the model
    with staging.loading(), torch.no_grad():
        model[1].weight.fill_(2.0)
    staging.switch({"1.weight"})
    assert torch.equal(model[1].weight, torch.full((2, 3), 2.0))
    assert torch.equal(model[0].weight, torch.ones(3, 4))  # what is served, copied back
    assert staging.current


def test_a_copy_made_stale_is_made_again_from_the_served_weights():
    model = _model()
    staging = StagedWeights(model)
    staging.refresh()
    with staging.loading(), torch.no_grad():
        model[0].weight.zero_()  # an update that is then aborted
    staging.stale()
    with torch.no_grad():
        model[1].bias.fill_(3.0)  # the served weights written otherwise
    staging.refresh()
    with staging.loading():
        copied = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(copied[n], p) for n, p in model.named_parameters())


def test_a_trainer_that_stages_refuses_an_engine_that_cannot_at_connect_and_bad_options():
    """`SyncOptions.staged` with a path it excludes fails when made; an engine without staged
    updates (the reference receiver) is refused at connect, before any sync."""
    import pytest

    from tests.conftest import free_port
    from weightsync import Probe, SyncOptions, TrainerSync
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

    for given, what in (
        ({"one_copy": True}, "one_copy=True"),
        ({"point_to_point": True}, "point_to_point=True"),
    ):
        with pytest.raises(ValueError, match=f"SyncOptions.staged=True with {what}: a staged"):
            SyncOptions(staged=True, **given)
    assert SyncOptions(staged=True, probe=Probe()).probe is not None  # probed after its switch
    init_trainer_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    model = torch.nn.Linear(4, 4)
    sync = TrainerSync(model, options=SyncOptions(staged=True))
    try:
        assert not sync.one_copy
        with pytest.raises(ValueError, match="engine 'plain' cannot take staged updates"):
            sync.connect({"plain": LocalEndpoint(ModuleWeightReceiver(model), name="plain")})
        assert sync.sender is not None and "plain" not in sync.sender.engines
    finally:
        sync.close()
        close_trainer_group()


def test_a_reloaded_model_gets_a_new_copy_and_a_switch_of_unknown_names_writes_nothing():
    """Parameters replaced behind the copy's back (an engine's own reload) are found at the
    next `refresh`; a switch naming what the copy does not hold refuses before writing."""
    import pytest

    model = _model()
    staging = StagedWeights(model)
    staging.refresh()
    model[0].weight = torch.nn.Parameter(torch.zeros(3, 4))  # replaced, as a reload may
    staging.stale()
    staging.refresh()
    with staging.loading(), torch.no_grad():
        model[0].weight.fill_(2.0)
    assert torch.equal(model[0].weight, torch.zeros(3, 4))  # the served one untouched
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="not parameters of the staged copy; nothing was"):
        staging.switch({"0.weight", "buffer.x"})
    assert all(torch.equal(p, served[n]) for n, p in model.named_parameters())
    staging.switch({"0.weight"})
    assert torch.equal(model[0].weight, torch.full((3, 4), 2.0))


@pytest.mark.gpu
def test_a_cuda_graph_captured_before_the_switch_computes_with_the_switched_weights():
    """The switch writes the served parameters in place, so a CUDA graph captured on them
    before (as an engine captures its forward at start) replays with the new weights, with
    no capture again; a staged load leaves the graph's answers as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)
    ).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)  # warm-up before capture, as torch asks
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
    graph.replay()
    before = out.clone()
    staging = StagedWeights(model)
    staging.refresh()
    new = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    with staging.loading(), torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(new[name])
        want = model(x)
    graph.replay()
    assert torch.equal(out, before)  # the served weights, while the update is staged
    staging.switch(set(new))
    graph.replay()
    torch.testing.assert_close(out, want)
    assert not torch.equal(out, before)


@pytest.mark.parametrize("swap", [False, True])
def test_prepare_makes_the_switchs_copies_ahead_and_the_switch_only_issues_them(monkeypatch, swap):
    """`prepare` (an engine's stage, before the pause) makes the batched copies of the switch
    that follows; the switch makes none of its own and writes the staged values (names it
    does not know, or packed ones, are left out of the plan, as the switch leaves them)."""
    import weightsync.engine.staging as staging_module

    made: list[int] = []
    for kind in (staging_module._Copies, staging_module._Swaps):
        original = kind.__init__

        def counted(self, pairs, original=original):
            made.append(len(pairs))
            original(self, pairs)

        monkeypatch.setattr(kind, "__init__", counted)
    model = _model()
    staging = StagedWeights(model)
    staging.refresh()
    with staging.loading(), torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].bias.fill_(3.0)
    names = {"0.weight", "1.bias"}
    assert staging.prepare(names | {"no.such"}, swap=swap, packed={"1.bias"}) >= 0
    assert made == [1]  # 0.weight alone: 1.bias is packed, no.such unknown
    staging.prepare(names, swap=swap)
    assert made == [1, 2]
    staging.switch(names, swap=swap)
    assert made == [1, 2]  # the switch issued the prepared copies
    assert torch.equal(model[0].weight, torch.ones(3, 4))
    assert torch.equal(model[1].bias, torch.full((2,), 3.0))


def _staged_ones(model: torch.nn.Module) -> tuple[StagedWeights, dict[str, torch.Tensor]]:
    """A staged copy of `model` whose every parameter the update set to its index + 1; the
    served values before it."""
    staging = StagedWeights(model)
    staging.refresh()
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    with staging.loading(), torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.fill_(i + 1.0)
    return staging, served


def _update(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p, i + 1.0) for i, (n, p) in enumerate(model.named_parameters())}


@pytest.mark.parametrize("fail_at", range(9))
def test_a_swapping_switch_that_fails_partway_is_undone_and_serves_the_previous_weights(
    monkeypatch, fail_at
):
    """`switch(swap=True)` in three chunks (a scratch buffer of one parameter's size), its
    `fail_at`-th batch of copies raising after it ran (each of the three steps of each chunk:
    scratch <- parameters, parameters <- copies, copies <- scratch): `SwitchUndone`, every
    parameter back on its previous values in its own memory, the copy holding the update,
    and the next swapping switch serves the update whole, the copy the previous weights."""
    from weightsync.engine import staging as staging_module
    from weightsync.engine.staging import SwitchUndone

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)
    )
    monkeypatch.setattr(staging_module, "SCRATCH_BYTES", 8 * 8 * 4)
    staging, served = _staged_ones(model)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    names = set(served)
    real, calls = staging_module._issue, []

    def planted(batches):
        real(batches)
        calls.append(1)
        if len(calls) == fail_at + 1:
            raise RuntimeError(f"planted: copy batch {fail_at} failed")

    monkeypatch.setattr(staging_module, "_issue", planted)
    with pytest.raises(SwitchUndone, match="swapped back") as caught:
        staging.switch(names, swap=True)
    assert f"planted: copy batch {fail_at} failed" in str(caught.value)
    monkeypatch.setattr(staging_module, "_issue", real)
    for name, param in model.named_parameters():
        assert torch.equal(param, served[name]), name
        assert param.data_ptr() == pointers[name]
    with staging.loading():
        assert all(torch.equal(p, _update(model)[n]) for n, p in model.named_parameters())
    assert not staging.current
    staging.switch(names, swap=True)
    assert all(torch.equal(p, _update(model)[n]) for n, p in model.named_parameters())
    with staging.loading():
        assert all(torch.equal(p, served[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("fail", ["first", "second"])
def test_a_swapping_switch_whose_packed_write_fails_is_undone(fail):
    """Packed parameters swap one at a time: the write of the first (before any swapped whole)
    or of the second (the first swapped, the plain ones too) raising partway, after writing
    part of the parameter: `SwitchUndone`, every parameter on its previous values, the copy
    on the update's."""
    from weightsync.engine.staging import Packed, SwitchUndone

    model = _model()
    staging, served = _staged_ones(model)
    order = ["0.weight", "1.weight"]
    writes: list[str] = []

    def write(name: str, param: torch.Tensor, copy: torch.Tensor) -> None:
        writes.append(name)
        if len(writes) == (1 if fail == "first" else 2):
            param.view(-1)[:1].copy_(copy.view(-1)[:1])  # part of it written
            raise RuntimeError("planted: the packed write failed")
        param.copy_(copy)

    def read(name: str, into: torch.Tensor, param: torch.Tensor) -> None:
        into.copy_(param)

    with pytest.raises(SwitchUndone, match="planted: the packed write failed"):
        staging.switch(set(served), swap=True, packed=Packed(set(order), write, read))
    for name, param in model.named_parameters():
        assert torch.equal(param, served[name]), name
    with staging.loading():
        assert all(torch.equal(p, _update(model)[n]) for n, p in model.named_parameters())


def test_a_copying_switch_that_fails_partway_is_not_undone(monkeypatch):
    """Without swap the previous values are gone once written: the error raises as it came."""
    from weightsync.engine import staging as staging_module

    model = _model()
    staging, _ = _staged_ones(model)

    def planted(batches):
        raise RuntimeError("planted: copies failed")

    monkeypatch.setattr(staging_module, "_issue", planted)
    with pytest.raises(RuntimeError, match="planted: copies failed") as caught:
        staging.switch({n for n, _ in model.named_parameters()})
    assert type(caught.value) is RuntimeError and not staging.current
