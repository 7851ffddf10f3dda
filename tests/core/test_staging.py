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
        ({"probe": Probe()}, "a probe"),
    ):
        with pytest.raises(ValueError, match=f"SyncOptions.staged=True with {what}: a staged"):
            SyncOptions(staged=True, **given)
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
