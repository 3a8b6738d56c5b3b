"""This process's node address as other nodes reach it (torch-free: the launcher's small host
actors read it without importing torch)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

#: This process's node address as other nodes reach it. The launcher sets it in every trainer
#: rank (Ray's address of the rank's node; loopback on a single-machine cluster).
NODE_IP_ENV = "MILES_NODE_IP"


def node_address(toward: str) -> str:
    """The address engines reach this process on: ``$MILES_NODE_IP``, else the local address of
    the route towards ``toward`` (an engine URL; a UDP ``connect`` picks the route and sends
    nothing)."""
    explicit = os.environ.get(NODE_IP_ENV)
    if explicit:
        return explicit
    host = urlsplit(toward).hostname or toward
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]
