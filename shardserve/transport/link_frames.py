"""A shard link's frames after the handshake: their format, their MAC, and cutting a byte stream into them.

Why every frame carries a MAC: the handshake (transport.link_auth) alone proves who opened the
connection, not who writes on it afterwards. Each direction has its own key (link_auth._Session),
and each frame ends in HMAC-SHA256(key, sequence number + header + payload) truncated to 16 bytes;
the sequence number counts that direction's frames (TCP keeps their order), so a frame altered,
replayed, reordered or reflected back fails to check, and the connection closes. Frames are
authenticated, not encrypted: a batch is query vectors and ids, and the link stays on the node or
the cluster's private network.

Frame: `<IQB` header (payload bytes, request id, status 0 = answer / 1 = error), the payload
(transport.shard_wire bytes, unchanged), the 16-byte MAC. Both ends of a link frame the same way
(transport.shard_link, transport.link_server), so this is the one place that knows the format.
"""

from __future__ import annotations

import hmac
import struct

_HEADER = struct.Struct("<IQB")
_SEQUENCE = struct.Struct("<Q")
_OK, _ERROR = 0, 1
TAG_BYTES = 16  # a frame's truncated MAC
MAX_FRAME = 16 * 1024 * 1024 + 4096  # payload bytes of one frame, unless a link says otherwise


class _Corrupt(Exception):
    """A stream nothing more can be read from: a frame over the limit, or one whose MAC fails."""


class _Seal:
    """One direction's frame MACs: HMAC-SHA256(key, sequence number + header + payload), truncated.
    Both ends count the direction's frames, so the sequence number is never sent."""

    def __init__(self, key: bytes):
        self._keyed = hmac.new(key, digestmod="sha256")  # copied per frame: the key is absorbed once
        self.sequence = 0

    def _mac(self, *parts: bytes | memoryview) -> bytes:
        mac = self._keyed.copy()
        mac.update(_SEQUENCE.pack(self.sequence))
        for part in parts:
            mac.update(part)
        self.sequence += 1
        return mac.digest()[:TAG_BYTES]

    def frame(self, request_id: int, status: int, body: bytes) -> bytes:
        """The next frame of this direction, its MAC appended."""
        head = _HEADER.pack(len(body), request_id, status)
        return b"".join((head, body, self._mac(head, body)))

    def check(self, framed: memoryview, tag: memoryview) -> bool:
        """Whether `tag` is the MAC of `framed` (header + payload) as the next frame of this direction."""
        return hmac.compare_digest(self._mac(framed), tag)


class _FrameBuffer:
    """Bytes received so far on one connection, cut into frames (header, payload, MAC) as they
    complete; each frame's MAC is checked against `incoming` before it is handed on."""

    def __init__(self, incoming: _Seal, max_frame: int = MAX_FRAME) -> None:
        self.buffer = bytearray()
        self.incoming = incoming
        self.max_frame = max_frame

    def frames(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """(request id, status, payload) of every frame completed by `data`. Raises _Corrupt on a
        frame longer than `max_frame` or one whose MAC fails (nothing after it can be trusted). Each
        payload is copied once; when nothing was pending, straight out of `data`."""
        source: bytes | bytearray
        if self.buffer:
            self.buffer += data
            source = self.buffer
        else:  # the common case: a receive holds whole frames, parse it without buffering it
            source = data
        found, offset = [], 0
        with memoryview(source) as view:
            while len(view) - offset >= _HEADER.size:
                length, request_id, status = _HEADER.unpack_from(view, offset)
                if length > self.max_frame:
                    raise _Corrupt(f"frame of {length} bytes, over {self.max_frame}")
                payload_end = offset + _HEADER.size + length
                end = payload_end + TAG_BYTES
                if len(view) < end:
                    break
                if not self.incoming.check(view[offset:payload_end], view[payload_end:end]):
                    raise _Corrupt("frame MAC did not check")
                found.append((request_id, status, bytes(view[offset + _HEADER.size:payload_end])))
                offset = end
            rest = bytes(view[offset:]) if source is data and offset < len(view) else None
        if source is data:
            if rest:
                self.buffer += rest
        elif offset:
            del self.buffer[:offset]
        return found
