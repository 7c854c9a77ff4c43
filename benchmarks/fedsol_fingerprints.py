"""FedSOL's fingerprints over its modes: a refactor's byte-identity check for fedsol.py.

``benchmarks/fingerprints.py`` runs every method with its default hyperparameters; FedSOL has
many paths (perturbed part, adaptive Lambda and its norm, KL / L2 / base proximal term, the
perturb / project / loss updates, rho 0, a combined base), so this runs each of 12 variants
on three models (iris MLP; digits ResNet-8 with BatchNorm; digits CNN), sequential, 3 rounds
of fingerprints.py's setting, and writes the SHA-256 of each run's metrics rows (FedSOL's
diagnostics included) and final weights. Run it before and after a change; the files must
be equal (about 20 minutes on 2 cores, most of it ResNet-8)::

    python benchmarks/fedsol_fingerprints.py before.json
    python benchmarks/fedsol_fingerprints.py after.json && cmp before.json after.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import fingerprints as F

from fedforget.config import MethodSpec
from fedforget.data import prepare_dataset

VARIANTS = [
    {}, {"perturb": "all"}, {"perturb": "body"}, {"adaptive": False}, {"lambda_norm": "column"},
    {"proximal": "l2"}, {"proximal": "base", "base": "fedprox", "base_params": {"mu": 0.1}},
    {"update": "project"}, {"update": "loss"}, {"update": "loss", "proximal": "l2"}, {"rho": 0.0},
    {"base": "scaffold", "base_loss": True},
]  # fmt: skip
MODELS = [("iris", "mlp"), ("digits", "resnet8"), ("digits", "cnn2d")]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = Path(tempfile.gettempdir()) / "fedforget-fedsol-fingerprints"
    root.mkdir(exist_ok=True)
    for d in {d for d, _ in MODELS}:
        prepare_dataset(d, {}, root)
    out = {}
    for ds, model in MODELS:
        for v in VARIANTS:
            rc = F.run_config(root, ds, model, {}, "fedsol", "sequential", None, None, rounds=3)
            rc = replace(rc, method=MethodSpec("fedsol", v, "fedsol"))
            out[f"{ds}-{model}-{json.dumps(v, sort_keys=True)}"] = F.one(rc)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(out)} runs -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
