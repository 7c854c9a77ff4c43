"""How the continual baselines order on the embedded streams (issue 16), against the
papers' orderings: the methods of the shipped FedProTIP Table 1 and FedGP Table 1 configs
(config/experiments/fedprotip_table1.yaml, fedgp_table1.yaml), one seed, one partition,
run in parallel processes, each reduced to ACC and forgetting as the aggregate tables
compute them (``fedforget.continual``).

Selected (``--which``):
- ``fedprotip``: FedProTIP Table 1 layout, split digits 5 x 2 class-IL, Dirichlet 0.5 over
  5 clients: experiments fedprotip_table1_shared / _heads / _glfc (FedAvg, FOT,
  FedProTIP(-t), FedProTIP, GLFC, LGA, TARGET, LANDER); metrics ACC and FT (%).
- ``fedgp``: FedGP Table 1 layout, split digits class-IL and task-IL, Dirichlet 0.3 over 10
  clients: FL, FL+FedGP, FL+iCaRL(+FedGP), GLFC(+FedGP), CFeD(+FedGP) (fedgp_table1_split,
  fedgp_table1_split_cfed); metric Acc_T (%). FL+L2P needs a pretrained ViT-B/16 and is left
  out.

    python benchmarks/continual_order.py --which fedprotip --seed 0 --jobs 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace

from fedforget.parse import load_config

SELECT = {
    "fedprotip": ("config/experiments/fedprotip_table1.yaml", {
        "fedprotip_table1_shared": None, "fedprotip_table1_heads": None, "fedprotip_table1_glfc": None,
    }, {"dataset": {"digits-class-il", "digits-class-il-heads"}, "partition": "dirichlet"}),
    "fedgp": ("config/experiments/fedgp_table1.yaml", {
        "fedgp_table1_split": {"FL", "FL+FedGP", "FL+iCaRL", "FL+iCaRL+FedGP", "GLFC", "GLFC+FedGP"},
        "fedgp_table1_split_cfed": None,
    }, {"dataset": None, "partition": None}),
}  # fmt: skip


def runs(which: str, seed: int, device: str, data_dir: str, results_dir: str):
    path, exps, keep = SELECT[which]
    out = []
    for rc in load_config(path).runs():
        methods = exps.get(rc.experiment, False)
        if methods is False or (methods is not None and rc.method.label not in methods) or rc.seed != seed:
            continue
        if keep["dataset"] and rc.dataset.label not in keep["dataset"]:
            continue
        if keep["partition"] and rc.partition.scheme != keep["partition"]:
            continue
        if which == "fedprotip" and rc.partition.scheme == "dirichlet" and rc.partition.alpha != 0.5:
            continue
        t = replace(rc.train, device=device, threads=1, eval_every=rc.dataset.scenario["rounds_per_task"])
        out.append(replace(rc, train=t, data_dir=data_dir, results_dir=results_dir))
    return out


def one(rc) -> dict:
    import torch

    from fedforget.continual import accuracy_matrix, continual_metrics
    from fedforget.engine import Simulation

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    sim = Simulation(rc)
    status, rows, msg = sim.run(progress=False)
    sc = rc.dataset.scenario
    task_rows = [t for r in rows for t in r.get("_tasks", [])]
    a = accuracy_matrix(task_rows, sc["tasks"], sc["rounds_per_task"])
    m = continual_metrics(a)
    return {
        "experiment": rc.experiment, "dataset": rc.dataset.label, "partition": rc.partition.slug,
        "method": rc.method.label, "status": status, "message": msg,
        "acc_pct": 100 * m["acc"], "fgt_pct": 100 * m["fgt"], "ft_pct": 100 * m["ft"],
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--which", choices=sorted(SELECT), default="fedprotip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--results-dir", default="/tmp/continual_order")
    p.add_argument("--only", default="", help="comma-separated method labels to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated method labels to leave out")
    p.add_argument("--json")
    a = p.parse_args()
    from fedforget.data import prepare_dataset

    todo = runs(a.which, a.seed, a.device, a.data_dir, a.results_dir)
    only, skip = set(filter(None, a.only.split(","))), set(filter(None, a.skip.split(",")))
    todo = [rc for rc in todo if (not only or rc.method.label in only) and rc.method.label not in skip]
    for name, opts in {(rc.dataset.name, json.dumps(rc.dataset.options, sort_keys=True)) for rc in todo}:
        prepare_dataset(name, json.loads(opts), a.data_dir)
    for pub in {json.dumps(rc.dataset.public, sort_keys=True) for rc in todo if rc.dataset.public}:
        spec = json.loads(pub)
        prepare_dataset(spec["dataset"], spec.get("options", {}), a.data_dir)
    results = []
    with ProcessPoolExecutor(a.jobs) as pool:
        futs = {pool.submit(one, rc): rc for rc in todo}
        for f in as_completed(futs):
            try:
                r = f.result()
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                rc = futs[f]
                r = {"experiment": rc.experiment, "dataset": rc.dataset.label, "method": rc.method.label,
                     "status": "error", "message": f"{type(e).__name__}: {e}"}  # fmt: skip
            results.append(r)
            print(json.dumps(r), flush=True)
    results.sort(key=lambda r: (r["dataset"], -(r.get("acc_pct") or -1)))
    print(f"\n{'dataset':24s} {'method':18s} {'ACC %':>7s} {'Fgt %':>7s} {'FT %':>7s} {'s':>6s}")
    for r in results:
        if r["status"] != "completed":
            print(f"{r['dataset']:24s} {r['method']:18s} {r['status']}: {r.get('message', '')[:80]}")
            continue
        print(f"{r['dataset']:24s} {r['method']:18s} {r['acc_pct']:7.2f} {r['fgt_pct']:7.2f} {r['ft_pct']:7.2f} {r['seconds']:6.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
