"""The engine's host side, torch-free: a request in the engine (`request.py`), the scheduler, what a
step's picks do on the host (`picks.py`, `output_processor.py`: tokens, stops, finish), streaming's
releases, token trees' bookkeeping, the grammar cache, the engine's health, the captures' bookkeeping,
the random streams, and the engine's caches' decisions: the prefix index (`prefix_index.py`) and the KV
cache manager (`kv_manager.py`), whose memory the runner keeps. The engine's test double (tests/fake_backend.py) runs this very code on its numpy
model; a test imports the whole package and finds no torch."""
