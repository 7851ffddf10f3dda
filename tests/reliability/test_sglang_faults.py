"""Bad input, failures mid-sync and long runs against a real SGLang engine (tiny OPT)."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from tests.engine_checks import assert_engine_matches_reference, prompt_ids
from weightsync import launcher
from weightsync.dtensor import DTensorV2Source
from weightsync.models import build_model, make_tiny_model
from weightsync.transports.shm import ShmSender, list_segments
from weightsync.wire import TensorMeta

NAME = "sglang"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("backends.sglang.engine.SglEngineActor", model)
    trainer = launcher.TrainerGroup("backends.sglang.worker.SglDTensorV2WeightSyncWorker",
                                    model_path=model, bucket_bytes=1 << 20, seed=0,
                                    timeout_s=30)
    trainer.call("connect", {NAME: engine})
    trainer.call("sync", "v0", verify=True)
    yield engine, trainer
    ray.shutdown()


def _unchanged(engine, prints, version):
    assert ray.get(engine.fingerprints.remote()) == prints
    assert ray.get(engine.weight_version.remote()) == version
    assert ray.get(engine.generate.remote(prompt_ids()))["weight_version"] == version


@pytest.mark.parametrize("case", ["missing", "duplicate", "empty", "other_architecture",
                                  "unknown_dtype"])
def test_bad_refit_info_is_rejected_before_any_weight_changes(setup, case):
    engine, trainer = setup
    prints = ray.get(engine.fingerprints.remote())
    specs = trainer.call("refit_info")
    bad, message = {
        "missing": ([s for s in specs if not s["name"].endswith("layers.1.fc2.weight")],
                    r"would get no trainer tensor.*layers.1.fc2.weight"),
        "duplicate": (specs + specs[:1], r"named twice.*embed_tokens"),
        "empty": ([], r"offers no tensors"),
        "other_architecture": ([s.to_dict() for s in
                                DTensorV2Source(build_model("gpt2", "tiny")).specs()],
                               r"no parameter for \d+ trainer tensor.*transformer\."),
        "unknown_dtype": ([dict(specs[0], dtype="float13")] + specs[1:],
                          r"unknown dtype 'float13'"),
    }[case]
    with pytest.raises(ValueError, match=message):
        ray.get(engine.check_refit.remote(bad))
    _unchanged(engine, prints, "v0")


def test_update_aborted_midway_is_never_served_and_the_next_sync_recovers(setup):
    engine, trainer = setup
    spec = trainer.call("refit_info")[0]  # the token embedding
    sender = ShmSender(num_slots=1)
    try:
        meta = TensorMeta(name=spec["name"], dtype=spec["dtype"], shape=tuple(spec["shape"]),
                          offset=0)
        buf = sender.buffer(0, meta.nbytes)
        buf.view(torch.float32).copy_(torch.randn(buf.numel() // 4))
        descriptor = {"index": 0, "nbytes": meta.nbytes, "handle": sender.handle(0),
                      "tensors": [meta.to_dict()]}
        ray.get(engine.begin.remote("half"))
        ray.get(engine.load_bucket.remote(descriptor))  # one tensor in, then the sender "dies"
        ray.get(engine.abort.remote("sender failed"))
    finally:
        sender.close()
    with pytest.raises(Exception, match="does not serve: update 'half' was aborted"):
        ray.get(engine.generate.remote(prompt_ids()))
    assert ray.get(engine.weight_version.remote()) == "v0"
    report = trainer.call("sync", "recovered", verify=True)
    assert report["verify"][NAME]["verified"]
    assert_engine_matches_reference(engine, trainer)


def test_an_update_left_open_by_a_dead_sender_is_aborted_by_the_next(setup):
    engine, trainer = setup
    ray.get(engine.begin.remote("orphan"))  # its sender never comes back
    report = trainer.call("sync", "after-orphan", verify=True)
    assert report["verify"][NAME]["verified"]
    assert ray.get(engine.weight_version.remote()) == "after-orphan"


def test_many_syncs_with_requests_leak_no_segments_or_descriptors(setup):
    engine, trainer = setup
    trainer.call("sync", "warm")
    ray.get(engine.generate.remote(prompt_ids()))
    segments = len(list_segments())
    engine_before = ray.get(engine.process_stats.remote())
    trainer_before = trainer.call("process_stats")
    for i in range(40):
        trainer.call("set_weights_from", i)
        trainer.call("sync", f"long-{i}")
        ray.get(engine.generate.remote(prompt_ids()))
    assert trainer.call("sync", "long-end", verify=True)["verify"][NAME]["verified"]
    engine_after = ray.get(engine.process_stats.remote())
    trainer_after = trainer.call("process_stats")
    print(f"40 syncs: shm segments {segments} -> {len(list_segments())}; engine fds "
          f"{engine_before['fds']} -> {engine_after['fds']}, rss "
          f"{engine_before['rss_bytes'] >> 20} -> {engine_after['rss_bytes'] >> 20} MiB; "
          f"trainer rank 0 fds {trainer_before['fds']} -> {trainer_after['fds']}")
    assert len(list_segments()) == segments
    assert engine_after["fds"] <= engine_before["fds"] + 2
    assert trainer_after["fds"] <= trainer_before["fds"] + 2
    assert engine_after["rss_bytes"] < engine_before["rss_bytes"] * 1.2 + (64 << 20)


def test_a_killed_engine_fails_the_sync_within_the_timeout_naming_it(setup):
    engine, trainer = setup
    ray.kill(engine.handle)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"engine 'sglang' (died|did not answer)"):
        trainer.call("sync", "after-kill")
    assert time.monotonic() - start < 60
