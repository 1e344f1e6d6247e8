"""Addresses and ports: which address a process on this node is reached at, and free ports.

On one machine every role talks over loopback; on a Ray cluster of several nodes, each actor
advertises the address of the node it runs on. Ray is looked at only where a process already
imported it (``sys.modules``): a process without Ray is on one node by definition, and the
engine-free commands (``trident sft``, the trainer measured alone) run where Ray is not installed.
"""

from __future__ import annotations

import socket
import sys


class PortInUseError(RuntimeError):
    """A configured port is taken on this host."""


def free_port() -> int:
    """A port that is free on this host now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise ``PortInUseError`` if ``port`` cannot be bound on ``host``."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise PortInUseError(
                f"port {port} on {host} is in use: pick another or use port 0 (any free port)"
            ) from None


def address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (the interface a packet to it leaves by):
    where a process there reaches this one. Sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def single_node() -> bool:
    """True when the Ray cluster has one live node (or Ray is not running)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return True
    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1


def node_ip() -> str:
    """The address other processes reach this one at: loopback on a single node, else the
    node's IP as Ray sees it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "127.0.0.1"
    ip = ray.util.get_node_ip_address()
    return "127.0.0.1" if ip in ("127.0.0.1", "localhost") or single_node() else ip
