"""A call on every rank of a trainer group that fails: the error that comes first is raised,
and it tells what every other rank did (real Ray actors; one dies mid-call); a call some rank
does not answer in time names the method and each rank's state."""

from __future__ import annotations

import os
import time

import pytest
import ray

from weightsync.driver import launcher


@pytest.fixture(scope="module")
def ray_job():
    launcher.init_ray(num_cpus=2)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def sync(self) -> str:
        if self.rank == 0:  # dies inside the call: its peers' collectives fail first
            time.sleep(1.0)
            os._exit(3)
        if self.rank == 1:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:10164")
        if self.rank == 2:
            time.sleep(0.5)
            return "done"
        time.sleep(60.0)  # a rank still inside the call
        return "late"


def test_a_failed_group_call_raises_the_first_error_with_every_ranks_outcome(ray_job):
    ranks = [Rank.remote(r) for r in range(4)]
    ray.get([r.__ray_ready__.remote() for r in ranks])
    call = launcher.GroupCall([r.sync.remote() for r in ranks], timeout_s=120)
    call.others_grace_s = 8.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection closed by peer") as raised:
        call.result()
    waited = time.monotonic() - start
    notes = raised.value.__notes__
    assert len(notes) == 1, notes
    note = notes[0]
    assert note.startswith("every rank of the call: rank 0: "), note
    rank0 = note.split("; ")[0]
    # the rank that died is named as such, not as one more failed collective
    assert "ActorDiedError" in rank0 or "RayActorError" in rank0, note
    assert "rank 1: RayTaskError(RuntimeError): RuntimeError: Connection closed by peer" in note
    assert "rank 2: answered" in note
    assert "rank 3: still running 8 s later" in note
    # the other ranks were given their grace, not the call's whole timeout
    assert 7.0 < waited < 30.0, waited
    for r in ranks:
        ray.kill(r)


def test_a_group_call_past_its_timeout_names_the_method_and_each_ranks_state(ray_job):
    ranks = [Rank.remote(r) for r in (2, 3)]  # one answers in 0.5 s, one takes 60 s
    ray.get([r.__ray_ready__.remote() for r in ranks])
    call = launcher.GroupCall([r.sync.remote() for r in ranks], timeout_s=3, method="sync")
    start = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        call.result()
    assert time.monotonic() - start < 20
    text = str(raised.value)
    assert text.startswith("trainer group call sync() not answered by every rank within 3 s"), text
    assert "rank 0: answered; rank 1: still running" in text, text
    for r in ranks:
        ray.kill(r)
