"""Online writes: the durable log, each shard's delta tier over its immutable base, and
the searches that see both. Plain Python and FAISS: no Ray, no Serve (deployments/ wires them)."""
