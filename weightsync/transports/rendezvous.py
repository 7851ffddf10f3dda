"""Where our listeners bind: the TCPStores we host and the gloo devices of our groups.

Given a host and a port, torch's TCPStore master listens on every interface whatever the host
says, and gloo's devices listen on the address the machine's hostname resolves to (on a cluster,
its public one). Each store here listens instead on a socket we bind to the host ourselves
(loopback unless a multi-node address is given), on port 0: the kernel picks a free port while
the socket is bound, and the store reports it. A port found by binding and closing a socket could
be taken by another process before the store listens on it; this one never leaves our hands.
The socket reaches torch as `master_listen_fd`, which torch 2.13, 2.14 and 2.15 take with either
store backend (libuv, their default, included); torch owns and closes it from then on.

Gloo devices are created on the local address from which the store's host is reached: 127.0.0.1
for a loopback store, the node's address on that network otherwise. Groups we build ourselves get
that device explicitly (`gloo_device`); groups torch builds (`init_process_group`, `new_group`,
a DeviceMesh's) take their devices from GLOO_SOCKET_IFNAME, which `use_gloo_interface_for` sets.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (`host`, `port`) and listening; port 0 lets the kernel choose."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def host_store(
    host: str = "127.0.0.1",
    *,
    port: int = 0,
    timeout_s: float = 300.0,
    world_size: int | None = None,
) -> dist.TCPStore:
    """A TCPStore master listening on `host` only, at `port` (0: a free port, read back from
    `store.port`). Clients join with `dist.TCPStore(host, store.port, is_master=False)`."""
    import torch.distributed as dist

    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        bound_port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def local_address(host: str) -> str:
    """This machine's address on the route to `host` (`host` itself when it is local)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(address)  # a UDP connect sends nothing: it only picks the route
        return sock.getsockname()[0]


def gloo_device(host: str) -> dist.ProcessGroupGloo.Device:
    """A gloo device listening on the local address that reaches `host`."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo.create_device(hostname=local_address(host))


def use_gloo_interface_for(host: str) -> str | None:
    """Make the gloo groups torch builds in this process listen on the interface that reaches
    `host` (GLOO_SOCKET_IFNAME, unless already set); returns the interface in effect."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    import psutil

    address = local_address(host)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return name
    return None
