"""This machine's processes from /proc: what stops a Ray (or HAProxy) we started, and only that."""

from __future__ import annotations

import os


def cmdline(pid: int) -> bytes:
    """NUL-separated command line ("" when the process is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() is not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_matching(fragment: bytes) -> list[int]:
    """Processes whose command line contains `fragment`."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and fragment in cmdline(int(e))]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(parent(int(entry)), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
