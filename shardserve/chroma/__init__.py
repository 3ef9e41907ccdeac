"""Chroma's API on shardserve collections: its data model (string ids, documents, metadata whose
keys come with writes, its filters and distances) in plain Python, translated to the native
collections by deployments.chroma."""
