"""Pick a TCP port for a server that binds it later, without racing the kernel for it."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(part) for part in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and outside the kernel's ephemeral range.

    Why not bind(0): that returns an ephemeral port, which the kernel hands to the next process
    that connects or binds port 0 before our server binds it. Seen in a test run: the port chosen
    for HAProxy's stats listener was given to Serve's controller first, and HAProxy could not start.
    Ports below the range are never handed out implicitly; a random start spreads callers, and a
    port is returned once per process."""
    low, high = _ephemeral_range()
    first, last = (20000, low - 1) if low > 21000 else (high + 1, 65535)
    span = last - first + 1
    start = random.randrange(span)
    for step in range(span):
        port = first + (start + step) % span
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port in {first}-{last} on {host}")
