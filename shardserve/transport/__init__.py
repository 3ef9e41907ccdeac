"""Bytes on the wire: the router's HTTP door, shard links and their frames."""
