"""Per-choice random streams that do not depend on the batch, the device or the order of steps.

A choice's stream is a key (fixed by the request's `seed` and the choice's index, or random when the
request has no seed) and a counter (how many tokens the choice has generated): the seed its next
token's random numbers are generated from is a pure function of the two, SplitMix64's output function
applied to `key + counter * gamma` (a counter-based generator, as Philox is). The sampler seeds the
device's own generator with it for that row and that step only (engine/device/sampler.py). So a seeded choice
draws the same numbers whatever else shares its batch and whatever it drew before, and the engine keeps
no generator state per sequence, nor moves one between host and device. No torch here: the test
double of the engine (tests/fake_backend.py) seeds numpy's generator from the same streams.
"""

from __future__ import annotations

import os

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, SplitMix64's increment


def _mix(z: int) -> int:
    """SplitMix64's output function: a bijection of 64-bit integers that scatters neighbouring inputs."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


class Stream:
    """The random numbers of one choice: `seed(step)`, 64 bits for the token at `step`."""

    __slots__ = ("key",)

    def __init__(self, seed: int | None, index: int):
        if seed is None:
            self.key = int.from_bytes(os.urandom(8), "little")
        else:
            # Seed and index each go through the mixer, so (seed, 1) and (seed + 1, 0) share nothing.
            self.key = _mix((_mix(int(seed) & _MASK) + index * _GAMMA) & _MASK)

    def seed(self, step: int) -> int:
        return _mix((self.key + (step + 1) * _GAMMA) & _MASK)
