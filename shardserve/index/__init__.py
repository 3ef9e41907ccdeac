"""The index format: storage, manifest, FAISS indexes, partitioning, metadata."""
