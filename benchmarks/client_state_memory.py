"""Host memory of what each paper config's jobs keep per client, per job.

SCAFFOLD, FedDyn and MOON keep one copy of the model per client, FedCurv three, a FedGP or
FedSOL over them its base's (``FedAvg.client_model_copies``); A-GEM, DER, FedGP, SCR keep a
replay buffer, iCaRL, GLFC and LGA exemplars, GPM (local memory) its bases, counted at their
fullest (``FedAvg.client_kept_bytes``: buffers of ``buffer_size`` rows, bases of d_l columns
per layer). tests/methods/test_resume_all_methods.py measures every method's state against
both. A client's state stays in host memory between its rounds, also on a GPU, so once every
client has trained a job holds clients x that (``fedforget.parse.client_state``, what
``fedforget validate`` prints). This script counts it for every config under ``--configs``
(default the paper configs) and writes, per config, each row and the largest. Jobs packed
in one SLURM submission share its ``mem_mb``: each declares its state as resource
``client_state_mb`` (``fedforget.parse.client_state_mb``) and takes ``slurm-packed-process-mb``
for its process, and ``slurm-packed`` runs at once only as many as fit (its ``packing``);
``largest_at_once`` is how many of the largest jobs train at once under ``--profile`` (its
``set-resources.train.mem_mb``, ``group-components`` for train and ``slurm-packed-process-mb``,
unset the plugin's default).
Counted, not measured: no job runs.

    python benchmarks/client_state_memory.py --json benchmarks/results/cpu-DATE/client_state_memory.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from fedforget.parse import client_state, load_config
from fedforget.utils import atomic_write_json
from snakemake_executor_plugin_slurm_packed import PROCESS_MB, packing

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=sorted(str(f) for f in (ROOT / "config/experiments/paper").glob("*.yaml")))
    p.add_argument("--profile", default=str(ROOT / "profiles/slurm/config.yaml"), help="the SLURM profile whose submissions pack the jobs")
    p.add_argument("--json", help="also write the numbers here")
    a = p.parse_args()
    profile = yaml.safe_load(Path(a.profile).read_text())
    mem_mb = profile["set-resources"]["train"]["mem_mb"]
    per_submission = int(dict(g.split("=") for g in profile.get("group-components", ["train=1"]))["train"])
    process_mb = profile.get("slurm-packed-process-mb", PROCESS_MB)

    def at_once(mb: int) -> int:
        """How many of ``per_submission`` jobs of ``mb`` MiB of state train at once."""
        plan = packing([SimpleNamespace(resources={"client_state_mb": mb})] * per_submission, mem_mb, process_mb)
        if plan is None:
            return per_submission
        k, cap = plan
        return k if cap is None or not mb else min(k, cap // mb)

    out: dict[str, Any] = {}
    for f in a.configs:
        rows = client_state(load_config(f))
        if not rows:
            continue
        largest = max(rows, key=lambda r: r["bytes"] or 0)
        mb = largest["client_state_mb"] or 0
        out[Path(f).stem] = {"rows": rows, "largest_gib": (largest["bytes"] or 0) / 2**30, "largest": largest,
                             "largest_client_state_mb": mb, "largest_at_once": at_once(mb)}  # fmt: skip
    for name, c in out.items():
        r = c["largest"]
        what = [f"{r['copies']} copies"] if r["copies"] else []
        what += [f"{r['kept_bytes'] / 2**20:,.1f} MiB kept"] if r["kept_bytes"] else []
        print(f"{name:<28} {c['largest_gib']:6.2f} GiB  {r['method']} on {r['model']} ({r['dataset']}), "
              f"{r['clients']} clients x ({' + '.join(what) or '?'}); {c['largest_at_once']} of {per_submission} at once")  # fmt: skip
    if a.json:
        atomic_write_json(a.json, {"what": "bytes of per-client state (float32 model copies; replay buffers, exemplars, bases at their fullest) once every client has trained, per job",
                                   "profile": {"path": os.path.relpath(a.profile, ROOT), "mem_mb": mem_mb,
                                               "group_components": per_submission, "process_mb": process_mb},
                                   "configs": out})  # fmt: skip


if __name__ == "__main__":
    main()
