"""Every listener we open binds the host given, loopback by default (weightsync/transports/rendezvous.py):
the collective transport's store and gloo devices, and the trainer group's store and gloo
devices. Listening sockets are read from the kernel (psutil), in every process involved."""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from tests.conftest import free_port
from weightsync.engine import server
from weightsync.transports.collective import CollectiveSender
from weightsync.transports.rendezvous import host_store, listening_socket


def _listening(pid: int | None = None) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }


def _multi_node_address() -> str:
    """An IPv4 address of this machine other than loopback, standing in for a node's address."""
    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if (
                name in up
                and a.family.name == "AF_INET"
                and not ipaddress.ip_address(a.address).is_loopback
            ):
                return a.address
    pytest.skip("this machine has no address but loopback")


def _receiver(requests, replies) -> None:
    from weightsync.transports import make_receiver

    receiver = make_receiver("gloo")
    handle, nbytes = requests.get()
    data = receiver.receive(handle, nbytes)
    replies.put((int(data.sum()), _listening()))
    requests.get()
    receiver.close()


def _collective_listeners(host: str) -> tuple[CollectiveSender, set, set]:
    """(sender, what this process began to listen on, what the receiver listens on) with one
    receiver process in the sender's gloo group."""
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(requests, replies))
    child.start()
    before = _listening()
    sender = CollectiveSender(num_receivers=1, backend="gloo", host=host, timeout_s=60)
    try:
        sender.buffer(0, 16).fill_(1)
        requests.put((sender.handle(0), 16))
        sender.send(0, 16)
        total, receiver_listens = replies.get(timeout=60)
        assert total == 16
        ours = _listening() - before
        requests.put(None)
    finally:
        sender.close()
        child.join(timeout=30)
    assert child.exitcode == 0
    return sender, ours, receiver_listens


def test_a_collective_sender_and_its_receiver_listen_on_loopback_only():
    sender, ours, theirs = _collective_listeners("127.0.0.1")
    assert ("127.0.0.1", sender.port) in ours
    assert len(ours) >= 2, f"the store and a gloo device, got {ours}"
    assert theirs, "the receiver's gloo device listens"
    assert {ip for ip, _ in ours | theirs} == {"127.0.0.1"}, (ours, theirs)


def test_a_collective_sender_given_a_multi_node_host_listens_there_only():
    host = _multi_node_address()
    sender, ours, theirs = _collective_listeners(host)
    assert (host, sender.port) in ours and theirs
    assert {ip for ip, _ in ours | theirs} == {host}, (ours, theirs)


def test_collective_senders_made_at_once_hold_distinct_ports_the_kernel_chose():
    before = _listening()
    with ThreadPoolExecutor(8) as pool:
        senders = list(
            pool.map(lambda _: CollectiveSender(num_receivers=1, timeout_s=10), range(8))
        )
    try:
        ports = [s.port for s in senders]
        assert len(set(ports)) == len(ports), ports
        assert _listening() - before == {("127.0.0.1", p) for p in ports}
        assert all(s.handle(0)["port"] == s.port for s in senders)
    finally:
        for s in senders:
            s.close()


def _trainer_rank(rank: int, host: str, port: int, rank0_hosts_store: bool, results) -> None:
    import torch.distributed as dist

    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group
    from weightsync.trainer.sync_group import SyncGroup

    init_trainer_group(
        rank=rank,
        world_size=2,
        master_addr=host,
        master_port=port,
        rank0_hosts_store=rank0_hosts_store,
    )
    group = SyncGroup(timeout_s=60)  # a gloo group of torch's `new_group`
    total = torch.ones(1)
    dist.all_reduce(total)
    results.put((rank, int(total[0]), _listening()))
    group.barrier()
    group.close()
    close_trainer_group()


def _trainer_group_listeners(host: str, *, driver_hosts: bool) -> tuple[set, set, int]:
    """(what this process began to listen on, what the two ranks listen on, the store's port)."""
    before = _listening()
    store = host_store(host, timeout_s=60) if driver_hosts else None
    port = store.port if store is not None else free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_trainer_rank, args=(r, host, port, not driver_hosts, results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    outs = {
        rank: (total, listens) for rank, total, listens in (results.get(timeout=120) for _ in procs)
    }
    ours = _listening() - before
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert outs[0][0] == outs[1][0] == 2
    return ours, outs[0][1] | outs[1][1], port


def test_a_trainer_group_hosted_by_the_driver_listens_on_loopback_only():
    ours, ranks, port = _trainer_group_listeners("127.0.0.1", driver_hosts=True)
    assert ours == {("127.0.0.1", port)}
    assert len(ranks) >= 4, f"two gloo groups (world, sync) on each rank, got {ranks}"
    assert {ip for ip, _ in ranks} == {"127.0.0.1"}, ranks


def test_a_trainer_group_hosted_by_rank_0_listens_on_loopback_only():
    ours, ranks, port = _trainer_group_listeners("127.0.0.1", driver_hosts=False)
    assert not ours
    assert ("127.0.0.1", port) in ranks
    assert {ip for ip, _ in ranks} == {"127.0.0.1"}, ranks


def test_a_trainer_group_given_a_multi_node_address_listens_there_only(monkeypatch):
    # The ranks choose their gloo interface from the address (an earlier test in this process
    # may have set one for loopback, which the spawned ranks would inherit).
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    host = _multi_node_address()
    ours, ranks, port = _trainer_group_listeners(host, driver_hosts=True)
    assert ours == {(host, port)}
    assert ranks and {ip for ip, _ in ranks} == {host}, ranks


def test_rank_0_cannot_host_the_store_on_port_0():
    from weightsync.trainer.process_group import init_trainer_group

    with pytest.raises(ValueError, match="master_port=0 with rank0_hosts_store=True"):
        init_trainer_group(rank=0, world_size=2, master_addr="127.0.0.1", master_port=0)


def test_a_trainer_group_on_an_unknown_device_is_refused_before_joining():
    """A device other than cpu/cuda is named in the error; nothing is joined (no store)."""
    import torch.distributed as dist

    from weightsync.trainer.process_group import init_trainer_group

    with pytest.raises(ValueError, match="device='tpu': pass 'cpu' \\(gloo\\) or 'cuda'"):
        init_trainer_group(
            rank=0, world_size=2, master_addr="127.0.0.1", master_port=1, device="tpu"
        )
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU is visible here; pass device='cpu'"):
            init_trainer_group(
                rank=0, world_size=2, master_addr="127.0.0.1", master_port=1, device="cuda"
            )
    assert not dist.is_initialized()


_HEALTH_SERVER = """
import argparse, http.server
parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args = parser.parse_args()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""


def test_an_engine_server_whose_port_was_taken_starts_again_on_another(monkeypatch):
    taken = listening_socket("127.0.0.1")
    ports = iter([taken.getsockname()[1]])
    free = server._free_port
    monkeypatch.setattr(server, "_free_port", lambda: next(ports, None) or free())
    local = server.LocalServer([sys.executable, "-c", _HEALTH_SERVER], name="health")
    try:
        assert local.base != f"http://127.0.0.1:{taken.getsockname()[1]}"
        assert local.request("GET", "/health")[0] == 200
    finally:
        local.shutdown()
        taken.close()


def _start_server_and_wait(queue) -> None:
    local = server.LocalServer([sys.executable, "-c", _HEALTH_SERVER], name="health")
    queue.put((local.proc.pid, local.base))
    time.sleep(600)  # killed by the test long before


def test_an_engine_server_stops_when_the_process_that_started_it_is_killed():
    """An engine actor killed outright (SIGKILL: no clean-up runs in it) takes its server's
    whole process group with it, within seconds, instead of leaving it listening."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    owner = ctx.Process(target=_start_server_and_wait, args=(queue,))
    owner.start()
    group, base = queue.get(timeout=120)
    members = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == group]
    assert len(members) >= 2  # the guard and the server
    assert server.http_json("GET", base + "/health", timeout=5)[0] == 200
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(timeout=30)
    gone, alive = psutil.wait_procs(members, timeout=20)
    assert not alive, f"still running 20 s after their owner was killed: {alive}"
    with pytest.raises(OSError):
        server.http_json("GET", base + "/health", timeout=5)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_attaching_to_a_url_where_no_server_answers_fails_naming_the_url():
    """`url=` on an engine actor: a URL with nothing listening is refused at once, naming it."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"vllm server at {url}: no answer to GET /health"):
        server.RemoteServer(url, name="vllm", api_key="k", timeout_s=5)
