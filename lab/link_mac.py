"""What the shard link's frame MACs cost: in-process, one thread, no sockets.

Every frame after the handshake carries HMAC-SHA256(session key, sequence + header + payload),
truncated (shardserve.transport.link_frames). This times sealing one frame and opening it again (cut
out of the byte stream, MAC checked, payload copied) against the same path with the MAC stubbed
out, for the frames a query batch makes: the router's 32 × 784 float32 batch to a shard, and a
shard's top-10 answer to it. The difference is what the MACs add per frame on each end; compare it
with the batch's search time, not with an empty link. Best of several rounds (the machine is shared).

    python -m lab.link_mac → records/link-mac.json
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from loadtests.record import header, save
from shardserve.transport.link_frames import TAG_BYTES, _FrameBuffer, _Seal
from shardserve.transport.shard_wire import ShardQuery, encode_answer


class _NoMac(_Seal):
    """The same framing without the MAC: what a frame cost before."""

    def _mac(self, *parts: bytes | memoryview) -> bytes:
        self.sequence += 1
        return bytes(TAG_BYTES)

    def check(self, framed: memoryview, tag: memoryview) -> bool:
        self.sequence += 1
        return True


def microseconds(seal: type[_Seal], payload: bytes, number: int, rounds: int) -> float:
    """Best per-frame time of seal + open."""
    key = bytes(range(32))
    sender, receiver = seal(key), _FrameBuffer(seal(key))

    def one() -> None:
        [(_, _, body)] = receiver.frames(sender.frame(1, 0, payload))
        assert len(body) == len(payload)

    return min(timeit.repeat(one, number=number, repeat=rounds)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--dim", type=int, default=784)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="link-mac")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch = ShardQuery(rng.random((args.rows, args.dim), dtype=np.float32), 10, {"nprobe": 16}).encode()
    answer = encode_answer(rng.random((args.rows, 10), dtype=np.float32),
                           rng.integers(0, 10**6, (args.rows, 10)), 1.0)
    found = {}
    for name, payload in (("batch", batch), ("answer", answer)):
        with_mac = microseconds(_Seal, payload, args.number, args.rounds)
        without = microseconds(_NoMac, payload, args.number, args.rounds)
        found[name] = {"bytes": len(payload), "us_with_mac": round(with_mac, 2),
                       "us_without_mac": round(without, 2), "mac_us": round(with_mac - without, 2),
                       "mac_ns_per_kib": round((with_mac - without) * 1e3 / (len(payload) / 1024), 1)}
    record = header(args.name, tool=None, threads=1, number=args.number, rounds=args.rounds,
                    unit="microseconds per frame, seal + open, best of the rounds", frames=found,
                    not_covered=["sockets and the event loop (the same with and without the MAC)",
                                 "a served load: make bench"])
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
