"""Which of FedProTIP's claims hold on our runs: paired per-seed differences from the runs of
config/experiments/fedprotip_table1.yaml and fedprotip_ablations.yaml (their
summary/runs.csv and metrics.parquet, written by the pipeline's aggregation).

Claims (papers/fedprotip.md): FedProTIP, and FedProTIP(-t), beat FOT (Table 1); projecting
during local training is more stable than FOT's projection of the aggregate under strong
heterogeneity (Sec. 1, 4.3: the gap should grow from IID to Dirichlet 0.2); TIP recovers the
task (Table 14: after each task, over the tasks so far); per-batch routing on single-task batches inflates task-agnostic accuracy
(METHODS.md: the authors' code routes per batch); and the ablations' rows (Tables 3, 8, 11),
communication per client and task (Table 9).

A stream is named by its dataset label without "-heads" (the per-task-head runs of the same
stream, data, partition and seed). "A vs B": the mean over seeds of A - B in percentage
points, its sample std, and on how many seeds A is better (higher ACC, lower FT). Only
seeds where both runs completed count.

    python benchmarks/fedprotip_claims.py          # after running both configs
    python benchmarks/fedprotip_claims.py --results results --csv fedprotip_claims.csv
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

T1_SHARED, T1_HEADS = "fedprotip_table1_shared", "fedprotip_table1_heads"
# (claim, (experiment, method, metric), (experiment, method, metric), better: +1 higher / -1 lower)
PAIRS = [
    ("FedProTIP beats FOT (shared head)", (T1_HEADS, "FedProTIP", "acc"), (T1_SHARED, "FOT", "acc"), 1),
    ("FedProTIP beats FOT (per-task heads)", (T1_HEADS, "FedProTIP", "acc"), (T1_HEADS, "FOT", "acc"), 1),
    ("FedProTIP forgets less than FOT (shared head)", (T1_HEADS, "FedProTIP", "ft"), (T1_SHARED, "FOT", "ft"), -1),
    ("FedProTIP(-t) beats FOT: local vs server-side projection, same head",
     (T1_SHARED, "FedProTIP-t", "acc"), (T1_SHARED, "FOT", "acc"), 1),
    ("FedProTIP(-t) forgets less than FOT", (T1_SHARED, "FedProTIP-t", "ft"), (T1_SHARED, "FOT", "ft"), -1),
    ("FedProTIP(-t) beats FedAvg", (T1_SHARED, "FedProTIP-t", "acc"), (T1_SHARED, "FedAvg", "acc"), 1),
    ("TIP beats no TIP (same run: routed vs newest-head scores)",
     (T1_HEADS, "FedProTIP", "acc"), (T1_HEADS, "FedProTIP", "acc_agnostic"), 1),
    ("TIP beats FedProTIP(-t) (Table 1: +TIP vs -t)", (T1_HEADS, "FedProTIP", "acc"), (T1_SHARED, "FedProTIP-t", "acc"), 1),
    ("task-aware above TIP (the oracle's margin)",
     (T1_HEADS, "FedProTIP", "acc_task_aware"), (T1_HEADS, "FedProTIP", "acc"), 1),
    ("per-batch routing inflates task-agnostic accuracy (batch - sample)",
     (T1_HEADS, "FedProTIP", "acc_tip_batch"), (T1_HEADS, "FedProTIP", "acc"), 1),
]  # fmt: skip


def stream(label: str) -> str:
    return label.removesuffix("-heads")


def runs_of(runs: pd.DataFrame, exp: str, method: str) -> pd.DataFrame:
    r = runs[(runs["experiment"] == exp) & (runs["method"] == method) & (runs["status"] == "completed")]
    return r.assign(stream=r["dataset"].map(stream)).set_index(["stream", "setting", "seed"])


def compare(runs: pd.DataFrame, claim: str, a: tuple, b: tuple, better: int) -> list[dict]:
    ra, rb = runs_of(runs, a[0], a[1]), runs_of(runs, b[0], b[1])
    if a[2] not in ra or b[2] not in rb:
        return []
    out = []
    for (st, setting), _ in ra.groupby(level=["stream", "setting"], sort=False):
        keys = [k for k in ra.index if k[:2] == (st, setting) and k in rb.index]
        if not keys:
            continue
        xa, xb = ra.loc[keys, a[2]].astype(float) * 100, rb.loc[keys, b[2]].astype(float) * 100
        d = xa.to_numpy() - xb.to_numpy()
        out.append({
            "claim": claim, "stream": st, "setting": setting, "a": f"{a[1]} {a[2]}", "b": f"{b[1]} {b[2]}",
            "seeds": len(keys), "value_a": xa.mean(), "value_b": xb.mean(), "diff": d.mean(),
            "diff_std": d.std(ddof=1) if len(d) > 1 else math.nan, "wins": int((better * d > 0).sum()),
        })  # fmt: skip
    return out


def spread(runs: pd.DataFrame, exp_prefix: str, metrics: list[str]) -> pd.DataFrame:
    """mean ± std over seeds of ``metrics`` (in %) per experiment x stream x setting x method."""
    r = runs[runs["experiment"].str.startswith(exp_prefix) & (runs["status"] == "completed")]
    cols = [m for m in metrics if m in r]
    g = r.assign(stream=r["dataset"].map(stream)).groupby(["experiment", "stream", "setting", "method"], sort=False)
    mean, std = g[cols].mean(), g[cols].std(ddof=1)
    out = mean.copy()
    for c in cols:
        scale = 1 if c == "wall_time_s" else 100
        out[c] = [f"{m * scale:.1f} ± {s * scale:.1f}" for m, s in zip(mean[c], std[c])]
    out["seeds"] = g.size()
    return out.reset_index()


def communication(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per task and client (MB), mean over runs: FOT's model + sketch, FedProTIP's model +
    bases + references (the task-end rows' fot_comm_* / fedprotip_comm_* columns)."""
    rows = []
    for prefix, method in (("fot_comm_", "FOT"), ("fedprotip_comm_", "FedProTIP")):
        cols = [c for c in metrics.columns if c.startswith(prefix)]
        if not cols:
            continue
        m = metrics[metrics["method"] == method].dropna(subset=[f"{prefix}task_mb"])
        m = m.assign(stream=m["dataset"].map(stream), task=m.groupby(["dataset", "setting", "seed"]).cumcount())
        for (st, task), g in m.groupby(["stream", "task"]):
            rows.append({"method": method, "stream": st, "task": task,
                         **{c.removeprefix(prefix): g[c].mean() for c in cols}})  # fmt: skip
    return pd.DataFrame(rows)


def tip_at_each_task(summaries: list[Path]) -> pd.DataFrame:
    """Table 14's layout: after task t, TIP's task-identity accuracy over the tasks seen so
    far (mean of task_id_<mode> on tasks 0..t), per sample and per batch, mean over seeds."""
    frames = [pd.read_parquet(s / "tasks.parquet") for s in summaries if (s / "tasks.parquet").exists()]
    t = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if "task_id_sample" not in t:
        return pd.DataFrame()
    t = t[(t["experiment"] == T1_HEADS) & t["task_id_sample"].notna() & (t["task"] <= t["current_task"])]
    last = t.groupby(["dataset", "setting", "seed", "current_task"])["round"].transform("max")
    t = t[t["round"] == last]  # the task's last round
    g = t.groupby(["dataset", "setting", "current_task", "seed"])[["task_id_sample", "task_id_batch"]].mean()
    out = g.groupby(level=["dataset", "setting", "current_task"]).mean() * 100
    return out.round(1).reset_index().rename(columns={"current_task": "after_task"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--csv", default=None)
    a = p.parse_args()
    summaries = sorted(Path(a.results).glob("fedprotip_*/summary"))
    if not summaries:
        raise SystemExit(f"no results/fedprotip_*/summary under {a.results!r}: run the FedProTIP configs first")
    runs = pd.concat([pd.read_csv(s / "runs.csv") for s in summaries], ignore_index=True)
    metrics = pd.concat(
        [pd.read_parquet(s / "metrics.parquet") for s in summaries if (s / "metrics.parquet").exists()],
        ignore_index=True,
    )
    pd.set_option("display.width", 250, "display.max_columns", 30, "display.max_rows", 200)
    rows = [r for claim, x, y, better in PAIRS for r in compare(runs, claim, x, y, better)]
    table = pd.DataFrame(rows)
    for claim, g in table.groupby("claim", sort=False):
        print(f"\n== {claim}")
        print(g.drop(columns=["claim"]).round(2).to_string(index=False))
    tip = ["acc", "ft", "acc_task_aware", "acc_agnostic", "acc_tip_batch", "acc_task_id_sample", "acc_task_id_batch"]
    print("\n== Table 1 (mean ± std over seeds, %)")
    print(spread(runs, "fedprotip_table1", tip).to_string(index=False))
    print("\n== Table 11: eps")
    print(spread(runs, "fedprotip_table11", tip).to_string(index=False))
    print("\n== Table 8: m_s (wall_time_s: the whole run, s)")
    print(spread(runs, "fedprotip_table8", [*tip, "wall_time_s"]).to_string(index=False))
    print("\n== Table 3: clients (5 at rate 1, 10 at 0.5, 20 at 0.25)")
    print(spread(runs, "fedprotip_table3", ["acc", "ft", "acc_task_id_sample"]).to_string(index=False))
    tip = tip_at_each_task(summaries)
    if len(tip):
        print("\n== TIP's task-identity accuracy over the tasks seen so far, after each task (%; Table 14)")
        print(tip.pivot(index=["dataset", "setting"], columns="after_task").to_string())
    comm = communication(metrics)
    if len(comm):
        print("\n== Communication per client and task (MB; Table 9)")
        print(comm.round(4).to_string(index=False))
    if a.csv:
        table.to_csv(a.csv, index=False)


if __name__ == "__main__":
    main()
