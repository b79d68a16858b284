"""logprobe: an OpenAI-compatible server for reading what a language model thinks of each token."""

import os

# Intel MKL (torch's CPU BLAS) splits a float32 matrix product's sums by thread count unless its strict
# Conditional Numerical Reproducibility mode is on: one process with two torch threads and a replica with
# one then give numbers that differ in the last bits (up to 2.3e-5 nats seen on the bundled model). MKL
# reads this once, when it first runs, so it is set on import, before torch is; a value the user set is
# kept. docs/cluster.md ("The same numbers") says what it covers.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
