"""Issue 32's GPU targets, read from the files a `benchmarks/gpu.sh` run wrote: each target's
measured value beside its threshold, and whether it is met. Nothing is timed here.

    python benchmarks/gpu_targets.py benchmarks/results/h200-2026-12-06 benchmarks/results/h200-2026-12-06/run2 \\
        --json benchmarks/results/h200-2026-12-06/targets.json

Folders are read in order, a later folder's file replacing an earlier one's of the same name (a
second device call's sections after the first's). A target whose file is absent (its section
skipped or cut) is listed as not measured, never as met. The thresholds are the issue's:

- ResNet-18 FedAvg (section resnet18: CIFAR-shaped blobs, 100 clients at Dirichlet 0.5, 10 per
  round, batch 64, 1 epoch): batched >= 3x the plain single-stream fp32 loop of the same
  process (``central``), sequential >= 0.9x;
- FedGP and FedProTIP on ResNet-18 (sections replay18, continual18): batched >= 2x sequential;
- FedSOL on ResNet-18 batched (section fedsol18's profile): the GPU busy >= 60 % of the wall
  time (the union of the kernels' and copies' intervals, ``profile_round.py``);
- VGG-11 (section vgg11): after the first 3 rounds, no round of the batched engine costs more
  than 1.2x its median round per training sample (a round that meets a new step shape against
  a warm one);
- the streamed pool (section stream): >= 0.9x the in-memory pool, batched;
- packing (section packing): 4 jobs on the GPU >= 2x the throughput of 1, ResNet-18 (and the
  McMahan CNN, where ``PACK_MCMAHAN=1`` ran it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (name, file, what is measured, threshold, at least (True) / at most (False))
TARGETS = [
    ("resnet18 batched / plain loop", "resnet18-dir-e1.json", "vectorized_over_central", 3.0, True),
    ("resnet18 sequential / plain loop", "resnet18-dir-e1.json", "sequential_over_central", 0.9, True),
    ("fedgp resnet18 batched / sequential", "resnet18-e1-fedgp.json", "vectorized_over_sequential", 2.0, True),
    ("fedprotip resnet18 batched / sequential", "resnet18-e1-fedprotip.json", "vectorized_over_sequential", 2.0, True),
    ("fedsol resnet18 batched, GPU busy %", "profile-resnet18-fedsol-batched.txt", "gpu_busy_percent", 60.0, True),
    ("vgg11 slowest / median round (s per sample)", "vgg11-dir-e1.json", "vectorized_round_spread", 1.2, False),
    ("streamed pool / in memory", "stream.json", "stream_over_device", 0.9, True),
    ("packing resnet18, 4 jobs / 1", "packing-resnet18-vectorized.json", "gain_4_jobs", 2.0, True),
    ("packing mcmahan, 4 jobs / 1", "packing-mcmahan.json", "gain_4_jobs", 2.0, True),
]
WARM_ROUNDS = 3  # the VGG-11 target counts the rounds after the first 3 (issue 32's wording)


def _ratio(over: str, under: str) -> Callable[[Path], float]:
    def read(path: Path) -> float:
        s = json.loads(path.read_text())["summary"]
        return s[over]["samples_per_s"] / s[under]["samples_per_s"]

    return read


def _gpu_busy(path: Path) -> float:
    """The busy share ``profile_round.py`` prints (the union of the GPU's intervals)."""
    m = re.search(r"GPU busy (\d+(?:\.\d+)?)%", path.read_text())
    if m is None:
        raise ValueError(f"{path}: no 'GPU busy N%' line (the profile failed: see the file)")
    return float(m.group(1))


def _round_spread(path: Path) -> float:
    """The batched engine's slowest round against its median round, per training sample (a
    round's seconds over its samples: rounds differ in how many rows their clients hold), the
    first ``WARM_ROUNDS`` rounds (warm-up included) left out, over every process's rounds.
    Files written before simulation.py kept each round's samples (``n_rounds``, 2026-12-05):
    the timed rounds' median samples/s over their slowest (every round after the warm-up)."""
    d = json.loads(path.read_text())
    runs = d["runs"]["vectorized"]
    if "n_rounds" not in runs[0]:
        s = d["summary"]["vectorized"]
        return s["samples_per_s"] / s["samples_per_s_min"]
    worst = 1.0
    for run in runs:
        rates = [n / sec for sec, n in zip(run["s_rounds"], run["n_rounds"], strict=True)][WARM_ROUNDS:]
        if len(rates) < 2:
            raise ValueError(f"{path}: {len(run['s_rounds'])} rounds, fewer than {WARM_ROUNDS + 2}")
        worst = max(worst, statistics.median(rates) / min(rates))
    return worst


def _stream(path: Path) -> float:
    return float(json.loads(path.read_text())["stream_over_device"])


def _gain_4(path: Path) -> float:
    rows = {r["jobs"]: r for r in json.loads(path.read_text())["results"]}
    if 4 not in rows:
        raise ValueError(f"{path}: no 4-job row (jobs measured: {sorted(rows)})")
    return float(rows[4]["gain"])


READERS: dict[str, Callable[[Path], float]] = {
    "vectorized_over_central": _ratio("vectorized", "central"),
    "sequential_over_central": _ratio("sequential", "central"),
    "vectorized_over_sequential": _ratio("vectorized", "sequential"),
    "gpu_busy_percent": _gpu_busy,
    "vectorized_round_spread": _round_spread,
    "stream_over_device": _stream,
    "gain_4_jobs": _gain_4,
}


def find(folders: list[Path], name: str) -> Path | None:
    """The last of ``folders`` holding ``name``."""
    hits = [f / name for f in folders if (f / name).is_file()]
    return hits[-1] if hits else None


def evaluate(folders: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for name, file, measure, threshold, at_least in TARGETS:
        path = find(folders, file)
        row: dict[str, Any] = {"target": name, "file": str(path) if path else file, "measure": measure,
                               "threshold": threshold, "at_least": at_least}  # fmt: skip
        if path is None:
            row.update(value=None, met=None, why="not measured: no such file in the folders given")
        else:
            try:
                value = READERS[measure](path)
            except (ValueError, KeyError, json.JSONDecodeError) as e:
                row.update(value=None, met=None, why=f"not measured: {type(e).__name__}: {e}")
            else:
                row.update(value=value, met=value >= threshold if at_least else value <= threshold)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="gpu.sh output folders, earlier first")
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    missing = [str(f) for f in a.folders if not f.is_dir()]
    if missing:
        raise SystemExit(f"gpu_targets.py: no such folder: {', '.join(missing)}")
    rows = evaluate(a.folders)
    for r in rows:
        want = f"{'>=' if r['at_least'] else '<='} {r['threshold']:g}"
        if r["value"] is None:
            print(f"{r['target']:<52} {'':>8} {want:<7}  {r['why']}")
        else:
            print(f"{r['target']:<52} {r['value']:8.2f} {want:<7}  {'met' if r['met'] else 'NOT met'}  ({r['file']})")
    if a.json:
        a.json.write_text(json.dumps({"folders": [str(f) for f in a.folders], "targets": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
