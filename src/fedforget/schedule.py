"""Which clients train in which round: the client schedule, keyed by (seed, round) only, so
every method of an experiment sees the same clients in the same rounds (the engine's loop
and a method that must know the round's clients ahead, CFeD's review split, read the same
function)."""

from __future__ import annotations

import numpy as np

from .utils import seed_sequence

SAMPLE_STREAM = 0x51  # stream tag of the client schedule (0x52: shuffling, 0x53: model init)


def sample_clients(seed: int, rnd: int, clients: int, rate: float) -> list[int]:
    """Clients sampled in round ``rnd`` (1-based): max(1, round(rate*K)) without
    replacement, from a generator keyed by (seed, round) only."""
    m = max(1, int(round(rate * clients)))
    if m >= clients:
        return list(range(clients))
    rng = np.random.default_rng(seed_sequence(seed, rnd, SAMPLE_STREAM))
    return sorted(int(c) for c in rng.choice(clients, size=m, replace=False))
