"""Text to vectors, in plain Python: the model an index was built with, its cache and its checks.

`model.Embedder` runs a model on ONNX Runtime with Hugging Face `tokenizers`; `model_files` says
where a model's files are (`resolve_model`) and what an index records of it (`ModelIdentity`);
`cache.EmbeddingCache` keeps vectors by model and exact text; `validate.check_text`/`check_texts`
refuse what no model should see; `text_data.real_texts` reads real English for tests and benchmarks.

Nothing is imported here: a router that only checks texts or reads the cache does not load ONNX
Runtime (tens of MB a process), only the embedder's own process does.
"""
