"""Rendezvous stores that listen on the loopback address only, for runs on one machine.

[Note: a local run listens on loopback only]
torch's ``TCPStore`` server listens on every interface (``[::]``, dual stack)
whatever host name it is given: ``TCPStore("127.0.0.1", port, is_master=True)``
accepts connections from the whole network. A store holds no secrets, but it
takes writes from anyone, and a peer that writes a rank's address into it can
stand in for that rank. So a run whose rendezvous address is a loopback
address (``planner run``'s default) creates its stores on a socket it has
bound to that address itself (``TCPStore(master_listen_fd=...)``):

* torchrun's agent (``runtime.agent``): the c10d rendezvous store, through the
  rendezvous backend ``planner-c10d`` (:func:`register_backend`);
* the workers (``runtime.mesh.init_mesh``): the process group's store, hosted
  by rank 0 (``planner run`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

gloo binds to the interface ``GLOO_SOCKET_IFNAME`` names (``lo``, set by
``planner run``). A run on several machines needs an explicit address (the
machines must reach each other) and gets torch's stores unchanged. Several
agents of one job on one machine, on a loopback endpoint (as
``tests/runtime/test_multinode.py`` runs two "machines"): the first hosts the
store, the others connect to it, as with torch's c10d.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from datetime import timedelta
from typing import Any

__all__ = ["BACKEND", "is_loopback", "listening_store", "register_backend"]

BACKEND = "planner-c10d"
"""The rendezvous backend name ``planner run`` passes to torchrun (``--rdzv-backend``)."""

_DEFAULT_PORT = 29400  # torchrun's c10d default


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listening_store(
    host: str,
    port: int,
    *,
    world_size: int | None = None,
    timeout_s: float = 300.0,
    multi_tenant: bool = False,
    wait_for_workers: bool = True,
) -> Any:
    """A ``TCPStore`` server listening on ``host`` only (see the note above).

    Example::

        store = listening_store("127.0.0.1", 29500, world_size=4, timeout_s=60)

    Raises:
        OSError: ``host:port`` cannot be bound (e.g. the port is taken).
    """
    import torch.distributed as dist

    family, kind, proto, _, addr = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here on
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            master_listen_fd=fd,
        )
    except BaseException:
        socket.socket(fileno=fd).close()
        raise


def _create_handler(params: Any) -> Any:
    """torchrun's c10d rendezvous, its store on a loopback-only socket when the endpoint is one."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
        create_backend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # torchrun checks it against --rdzv-backend
            return BACKEND

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=_DEFAULT_PORT)
    is_host = params.get_as_bool("is_host")
    if not is_loopback(host) or is_host is False or params.get("store_type", "tcp") != "tcp":
        _, store = create_backend(params)
    else:  # the agent on this machine hosts the store (planner run: one node)
        timeout = int(params.get_as_int("read_timeout", 60) or 60)
        try:
            store = listening_store(host, port, timeout_s=timeout, multi_tenant=True)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or is_host is True:
                raise
            # another agent of this job on this machine hosts it (several agents on one
            # machine, as torch's c10d allows; `planner run` checks its port beforehand)
            import torch.distributed as dist

            store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
    return create_handler(store, Backend(store, params.run_id), params)


def register_backend() -> None:
    """Make ``--rdzv-backend planner-c10d`` known to torchrun in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
