"""shardserve.runtime.ports: ports a server binds later are never ones the kernel hands out by itself."""

from __future__ import annotations

import socket

from shardserve.runtime.ports import _ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(not low <= port <= high for port in ports), (low, high, ports)
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))

