from __future__ import annotations

import multiprocessing as mp
import os
import re
import resource
import secrets
import stat
import subprocess
import sys

import pytest
import torch

from weightsync.transports.shm import (
    PREFIX,
    SHM_DIR,
    ShmReceiver,
    ShmSender,
    _Segment,
    list_segments,
    sweep_stale_segments,
)
from weightsync.wire.bucket import fill_buckets, plan_buckets
from weightsync.wire.fingerprint import fingerprint
from weightsync.wire.specs import BucketDescriptor, TensorSpec


def _receiver_process(requests, replies):
    """Another process: maps each bucket, answers {name: fingerprint}."""
    from weightsync.wire.bucket import unpack

    receiver = ShmReceiver()
    while (item := requests.get()) is not None:
        desc = BucketDescriptor.from_dict(item)
        views = unpack(receiver.receive(desc.handle, desc.nbytes), desc)
        replies.put({name: fingerprint(view) for name, view in views})
        del views
    receiver.close()
    replies.put("closed")


def test_buckets_cross_to_another_process_intact():
    g = torch.Generator().manual_seed(1)
    tensors = [(f"layer.{i}", torch.randn(100 + i, 7, generator=g).bfloat16()) for i in range(20)]
    plans = plan_buckets([TensorSpec.of(n, t) for n, t in tensors], capacity_bytes=4096)
    assert len(plans) > 2
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver_process, args=(requests, replies))
    child.start()
    sender = ShmSender(num_slots=2)
    got = {}
    try:
        for plan in fill_buckets(
            plans, iter(tensors), lambda p: sender.buffer(p.index % 2, p.nbytes)
        ):
            requests.put(plan.descriptor(sender.handle(plan.index % 2)).to_dict())
            got.update(replies.get(timeout=60))
        requests.put(None)
        assert replies.get(timeout=60) == "closed"
    finally:
        sender.close()
        child.join(timeout=30)
    assert got == {name: fingerprint(t) for name, t in tensors}


def test_segments_are_owner_only_and_unlinked_on_close():
    sender = ShmSender(num_slots=2)
    sender.buffer(0, 1000)
    name = sender.handle(0)["name"]
    mode = os.stat(f"/dev/shm/{name}").st_mode
    assert stat.S_IMODE(mode) == 0o600
    sender.close()
    assert name not in list_segments()


def test_segments_of_a_crashed_sender_are_swept():
    code = (
        "import os; from weightsync.transports.shm import ShmSender; "
        "s = ShmSender(); s.buffer(0, 4096); print(s.handle(0)['name'], flush=True); "
        "os._exit(9)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert name in list_segments()
    assert name in sweep_stale_segments()
    assert name not in list_segments()


def test_segments_are_unlinked_at_exit_when_close_never_ran():
    code = (
        "from weightsync.transports.shm import ShmSender; "
        "s = ShmSender(); s.buffer(0, 4096); s.buffer(1, 64); "
        "print(s.handle(0)['name'], s.handle(1)['name'], flush=True)"
    )  # exits normally
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    names = out.stdout.split()
    assert len(names) == 2
    assert not set(names) & set(list_segments())


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return int(child.stdout)


def test_a_new_sender_sweeps_what_dead_processes_left_reply_folders_included():
    pid = _dead_pid()
    segment = os.path.join(SHM_DIR, f"weightsync-{pid}-{secrets.token_hex(4)}-0-1")
    folder = os.path.join(SHM_DIR, f"weightsync-{pid}-replies-{secrets.token_hex(4)}")
    with open(segment, "wb") as f:
        f.write(b"\0" * 64)
    os.mkdir(folder)
    with open(os.path.join(folder, "reply.json"), "w") as f:
        f.write("{}")
    sender = ShmSender()  # sweeps on construction, nothing called by hand
    try:
        assert not os.path.exists(segment)
        assert not os.path.exists(folder)
    finally:
        sender.close()


def test_a_dead_engines_shared_parameter_segment_is_swept():
    code = (
        "import os, torch; from weightsync.engine.one_copy.segment import SharedParameters; "
        "p = {'w': torch.nn.Parameter(torch.ones(64, 4), requires_grad=False)}; "
        "s = SharedParameters(p, {'w': ('w', 0)}); "
        "print(s.segment.name, flush=True); os._exit(9)"
    )  # dies without unlinking
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert name.startswith("weightsync-") and "-params-" in name, out.stderr[-2000:]
    assert name in list_segments()
    sender = ShmSender()  # the next sender on the host sweeps it
    try:
        assert name not in list_segments()
    finally:
        sender.close()


def test_receiver_reports_a_vanished_segment():
    sender = ShmSender()
    sender.buffer(0, 64)
    handle = sender.handle(0)
    sender.close()
    with pytest.raises(RuntimeError, match="is gone"):
        ShmReceiver().receive(handle, 64)


def _free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("planted", ["file", "dangling symlink"])
def test_an_existing_file_at_a_new_segments_name_is_refused_not_reused(tmp_path, planted):
    # Refused rather than retried under a fresh name: names carry 32 random bits, so a file
    # already there was planted or leaked, and the user should see it.
    name = f"weightsync-{os.getpid()}-{secrets.token_hex(4)}-0-1"
    path = tmp_path / name
    if planted == "file":
        path.write_bytes(b"theirs")
        path.chmod(0o644)
    else:
        path.symlink_to(tmp_path / "target")
    with pytest.raises(
        RuntimeError,
        match=rf"segment '{re.escape(str(path))}' exists already \(owner uid "
        rf"{os.getuid()}, mode 0o[0-7]+\); weightsync creates "
        rf"each segment new and never reuses a file; remove it",
    ):
        _Segment(name, 4096, create=True, shm_dir=str(tmp_path))
    if planted == "file":
        assert path.read_bytes() == b"theirs" and stat.S_IMODE(path.stat().st_mode) == 0o644
    else:
        assert not (tmp_path / "target").exists()


def test_receiver_refuses_a_segment_others_may_read():
    sender = ShmSender()
    try:
        sender.buffer(0, 64)
        handle = sender.handle(0)
        os.chmod(os.path.join(SHM_DIR, handle["name"]), 0o644)
        with pytest.raises(
            RuntimeError,
            match=(
                rf"segment '{SHM_DIR}/{handle['name']}' has owner uid {os.geteuid()}, mode "
                rf"0o644; weightsync maps only regular files owned by its own uid "
                rf"\({os.geteuid()}\) with no group or other permission bits .* run the trainer "
                rf"and the engines as the same user"
            ),
        ):
            ShmReceiver().receive(handle, 64)
    finally:
        sender.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_receiver_refuses_a_segment_owned_by_another_uid():
    sender = ShmSender()
    try:
        sender.buffer(0, 64)
        handle = sender.handle(0)
        os.chown(os.path.join(SHM_DIR, handle["name"]), 65534, 65534)
        with pytest.raises(
            RuntimeError,
            match=rf"segment '{SHM_DIR}/{handle['name']}' has "
            rf"owner uid 65534, mode 0o600; .* own uid",
        ):
            ShmReceiver().receive(handle, 64)
    finally:
        sender.close()


def test_receiver_refuses_a_symlink_at_a_segments_name(tmp_path):
    target = tmp_path / "own-file"
    target.write_bytes(bytes(4096))
    target.chmod(0o600)
    name = f"weightsync-{os.getpid()}-{secrets.token_hex(4)}-0-1"
    (tmp_path / name).symlink_to(target)
    with pytest.raises(
        RuntimeError, match=rf"segment '{re.escape(str(tmp_path / name))}' is a symbolic link"
    ):
        ShmReceiver(shm_dir=str(tmp_path)).receive({"name": name}, 64)


def test_receiver_refuses_a_segment_smaller_than_the_bytes_asked_for():
    sender = ShmSender()
    try:
        sender.buffer(0, 64)
        handle = sender.handle(0)
        size = handle["nbytes"]
        with pytest.raises(
            ValueError,
            match=rf"holds {size} bytes, fewer than the "
            rf"{size + 1} the descriptor names",
        ):
            ShmReceiver().receive(handle, size + 1)
    finally:
        sender.close()


def test_a_segment_larger_than_its_directorys_free_space_is_refused_before_a_file_is_made(tmp_path):
    free_bytes = _free_bytes(tmp_path)
    nbytes = free_bytes + (1 << 30)
    with pytest.raises(
        RuntimeError,
        match=(
            rf"needs {nbytes} bytes but {re.escape(str(tmp_path))} has \d+ free; give the shared-memory "
            rf"filesystem more room \(Docker: --shm-size.*\) or sync in smaller buckets "
            rf"\(a smaller bucket_bytes\)"
        ),
    ):
        _Segment("weightsync-0-big", nbytes, create=True, shm_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_sender_refuses_a_bucket_larger_than_dev_shm_before_making_a_segment():
    before = list_segments()
    sender = ShmSender()
    try:
        with pytest.raises(RuntimeError, match=rf"bytes but {SHM_DIR} has \d+ free; .*--shm-size"):
            sender.buffer(0, 2 * _free_bytes(SHM_DIR))
        # This process's segments only: other suites may run beside this one.
        mine = f"{PREFIX}{os.getpid()}-"
        assert [n for n in list_segments() if n not in before and n.startswith(mine)] == []
    finally:
        sender.close()


def test_a_failed_allocation_removes_the_file_and_names_the_fix(tmp_path):
    # A real posix_fallocate failure: a file-size limit below the segment's size (EFBIG; Python
    # ignores SIGXFSZ), after the free-space check has passed.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(
            RuntimeError,
            match=(
                r"allocating 4194304 bytes failed \(File too large; .* had \d+ free\); give the "
                r"shared-memory filesystem more room"
            ),
        ):
            _Segment("weightsync-0-limited", 4 << 20, create=True, shm_dir=str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == []


def test_a_closed_segment_stays_mapped_while_a_view_of_it_lives(tmp_path):
    """`_Segment.close()` lets go of the mapping without unmapping it under live tensors (a
    write through a view of an unmapped segment would land in whatever is mapped there next):
    a view keeps working after close, and the mapping goes with the last view."""
    import gc

    segment = _Segment("weightsync-test-close", 1 << 20, create=True, shm_dir=str(tmp_path))
    path = str(tmp_path / "weightsync-test-close")

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(path in line for line in f)

    view = segment.tensor[4096:8192]
    segment.close()
    del segment
    gc.collect()
    assert mapped()
    view.fill_(7)  # still this segment's memory
    assert int(view.sum()) == 7 * 4096
    del view
    gc.collect()
    assert not mapped()
