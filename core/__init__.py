"""The plain-Python layer every stage builds on; it imports nothing above it and nothing of Ray Serve.

- index format: storage (any pyarrow filesystem), manifest, indexes (factory, params, vectors);
- data: datasets (parsers), groundtruth (exact top-k, cached);
- the query path: api (HTTP contract), batcher, fanout, merge, searcher, shard_wire, shard_link,
  index_pointer, openapi;
- process and session helpers: errors, timing, procfs (/proc), ray_session, ray_private (the one place
  that touches Ray's private APIs).
"""
