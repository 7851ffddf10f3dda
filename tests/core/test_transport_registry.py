"""The transport registry (one name per transport, both sides) and the capabilities the
transport ABCs declare."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest
import torch

from weightsync.transports import (
    ReceiverTransport,
    SenderTransport,
    make_receiver,
    make_sender,
    register_transport,
    transport_names,
)
from weightsync.wire.bucket import plan_buckets
from weightsync.wire.specs import TensorSpec


def test_every_sync_option_transport_is_registered_and_nothing_else():
    from weightsync.trainer.sync import Transport

    assert transport_names() == list(get_args(Transport))


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match=r"transport 'shm' is registered already"):
        register_transport("shm", sender="a:B", receiver="a:C")


def test_a_target_must_name_module_and_class():
    with pytest.raises(ValueError, match=r"receiver='weightsync.transports.shm': expected"):
        register_transport("mine", sender="a:B", receiver="weightsync.transports.shm")
    assert "mine" not in transport_names()


def test_an_unknown_name_lists_the_registered_ones():
    message = r"unknown transport 'tcp'; registered: \['shm', 'cuda_ipc', 'gloo', 'nccl'\]"
    with pytest.raises(ValueError, match=message):
        make_sender("tcp", num_receivers=1)
    with pytest.raises(ValueError, match=message):
        make_receiver("tcp")


def test_a_side_is_imported_only_when_it_is_made():
    code = (
        "import sys\n"
        "from weightsync.transports import make_receiver\n"
        "mods = ('weightsync.transports.shm', 'weightsync.transports.cuda_ipc',\n"
        "        'weightsync.transports.collective')\n"
        "assert not [m for m in mods if m in sys.modules], sys.modules.keys()\n"
        "make_receiver('shm').close()\n"
        "assert 'weightsync.transports.shm' in sys.modules\n"
        "assert 'weightsync.transports.collective' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_the_sender_writes_its_registered_name_into_every_handle():
    shm = make_sender("shm", num_receivers=1)
    try:
        shm.buffer(0, 64)
        assert shm.handle(0)["kind"] == "shm" and shm.num_slots == 2
        assert not shm.takes_tensors
    finally:
        shm.close()
    gloo = make_sender("gloo", num_receivers=1, timeout_s=5)
    try:
        assert gloo.handle(0)["kind"] == "gloo" and gloo.takes_tensors
        assert type(make_receiver(gloo.handle(0)["kind"])).__name__ == "CollectiveReceiver"
    finally:
        gloo.close()


def test_a_slot_without_a_buffer_has_no_handle():
    shm = make_sender("shm", num_receivers=1)
    try:
        with pytest.raises(RuntimeError, match=r"handle\(1\) before buffer\(1, nbytes\)"):
            shm.handle(1)
    finally:
        shm.close()


class _Bytes(SenderTransport):
    kind = "bytes"

    def __init__(self) -> None:
        self.data = torch.zeros(256, dtype=torch.uint8)

    def buffer(self, slot, nbytes):
        return self.data[:nbytes]

    def handle(self, slot):
        return {"kind": self.kind}

    def close(self):
        pass


class _BytesReceiver(ReceiverTransport):
    def __init__(self, sender: _Bytes) -> None:
        self.sender = sender

    def receive(self, handle, nbytes):
        return self.sender.data[:nbytes]

    def close(self):
        pass


def test_undeclared_capabilities_have_their_documented_defaults():
    sender = _Bytes()
    assert sender.num_slots == 1 and not sender.takes_tensors
    plan = plan_buckets([TensorSpec(name="w", dtype="float32", shape=(4,))], capacity_bytes=256)[0]
    with pytest.raises(NotImplementedError, match="_Bytes does not take tensors"):
        sender.attach(0, plan, [torch.ones(4)])
    sender.buffer(0, plan.nbytes).view(torch.float32)[:4] = torch.arange(4.0)
    pairs = _BytesReceiver(sender).receive_tensors(plan.descriptor(sender.handle(0)))
    assert [n for n, _ in pairs] == ["w"] and torch.equal(pairs[0][1], torch.arange(4.0))
