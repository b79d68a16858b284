"""The runners, which own the model's passes and every tensor they keep (engine/contract.py says what the
engine asks of them): `lean/` (logprobe's own forward pass, batched decode, prompt-only batches) with the
KV cache's memory in size classes (`kv_cache.py`; where rows go is the engine's manager's,
host/kv_manager.py), the prefix cache's memory (`prefix_cache.py`; its index is the engine's,
host/prefix_index.py) and the model families it
runs (`families/`); `model_runner.py` (transformers' forward, a cache per request); what both use:
prompt columns (`prompt_columns.py`), interventions (`interventions.py`); loading (`loader.py`,
`int4.py`)."""
