"""The engine's host side, torch-free: a request in the engine (`request.py`), the scheduler, what a
step's picks do on the host (`picks.py`, `output_processor.py`: tokens, stops, finish), streaming's
releases, token trees' bookkeeping, the grammar cache, the engine's health, the captures' bookkeeping
and the random streams. The engine's test double (tests/fake_backend.py) runs this very code on its numpy
model; a test imports the whole package and finds no torch."""
