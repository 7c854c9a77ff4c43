"""Shared by the continual cost benchmarks (continual_cost.py, fedprotip_cost.py): time each
simulation's task ends apart from its rounds."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


def time_task_ends(sims: Mapping[str, Any]) -> dict[str, list[float]]:
    """Turn off each simulation's per-round global evaluation and wrap its ``end_task`` so
    that every call's wall time is appended to the returned list of its name; a round's own
    time is then its wall time less the task ends it ran."""
    task_end: dict[str, list[float]] = {n: [] for n in sims}
    for n, sim in sims.items():
        sim.global_metrics = lambda rnd: ({}, [])  # no evaluation in the timed loop
        inner = sim.end_task

        def timed_end(rnd, lr, inner=inner, n=n):
            t0 = time.perf_counter()
            inner(rnd, lr)
            task_end[n].append(time.perf_counter() - t0)

        sim.end_task = timed_end
    return task_end
