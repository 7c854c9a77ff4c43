"""Which of FedGP's claims hold on our runs: paired per-seed differences from the runs of
config/experiments/fedgp_table1.yaml and fedgp_ablations.yaml (their summary/runs.csv,
written by the pipeline's aggregation).

Claims (papers/fedgp.md): FedGP raises ACC for every base (Table 1) and lowers forgetting
(Table 11), also with larger buffers (Table 2) and asynchronous boundaries (Table 4);
projecting on conflict beats projecting always, and beats the other manipulations (Table 7);
a higher projection rate is better (Table 8); reservoir sampling beats sliding-window and
random buffers (Table 9).

For each comparison "A vs B" on one dataset: the mean over seeds of A - B (ACC and Fgt_T in
percentage points; the runs of a seed share data, partition and client schedule), its
sample std, and on how many seeds A is better (higher ACC, lower Fgt_T). Only seeds where
both runs completed count.

    python benchmarks/fedgp_claims.py                 # after running both configs
    python benchmarks/fedgp_claims.py --results results --csv fedgp_claims.csv
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

BASES = ["FL", "FedProx", "FedCurv", "FL+A-GEM", "FL+DER"]
PAIRS: list[tuple[str, str, str, str]] = []  # (claim, experiment, A, B): "A beats B"
for exp in ("fedgp_table1_split", "fedgp_table1_domain"):
    PAIRS += [("FedGP improves its base (Tables 1, 11)", exp, f"{b}+FedGP", b) for b in BASES]
for exp in ("fedgp_table2_split", "fedgp_table2_rotated"):
    for size in (20, 50, 1000):
        PAIRS += [
            (f"FedGP improves its base at buffer {size} (Table 2)", exp, f"{b}+FedGP-B{size}", f"{b}-B{size}")
            for b in ("FL+A-GEM", "FL+DER")
        ]
PAIRS += [("FedGP improves its base, asynchronous boundaries (Table 4)", "fedgp_table4_async", f"{b}+FedGP", b)
          for b in ("FL+A-GEM", "FL+DER")]  # fmt: skip
PAIRS += [("FedGP improves FL (Tables 7-9)", "fedgp_table7_9", "FedGP", "FL")]
PAIRS += [("on conflict beats always (Table 7)", "fedgp_table7_9", f"{m}-conflict" if m != "project" else "FedGP", f"{m}-always")
          for m in ("project", "average", "rotate", "project_scale")]  # fmt: skip
PAIRS += [("project beats the other manipulations (Table 7)", "fedgp_table7_9", "FedGP", f"{m}-conflict")
          for m in ("average", "rotate", "project_scale")]  # fmt: skip
PAIRS += [("p = 100 % beats a lower rate (Table 8)", "fedgp_table7_9", "FedGP", f"FedGP-p{p}") for p in (10, 50, 80)]
PAIRS += [("reservoir beats the other buffers (Table 9)", "fedgp_table7_9", "FedGP", f"FedGP-{b}-buffer")
          for b in ("sliding", "random")]  # fmt: skip


def compare(runs: pd.DataFrame, claim: str, exp: str, a: str, b: str) -> list[dict]:
    out = []
    r = runs[(runs["experiment"] == exp) & (runs["status"] == "completed")]
    for ds, g in r.groupby("dataset", sort=False):
        ra = g[g["method"] == a].set_index("seed")
        rb = g[g["method"] == b].set_index("seed")
        seeds = sorted(set(ra.index) & set(rb.index))
        if not seeds:
            continue
        row = {"claim": claim, "experiment": exp, "dataset": ds, "a": a, "b": b, "seeds": len(seeds)}
        for m, better in (("acc", 1), ("fgt", -1)):
            d = (ra.loc[seeds, m].astype(float) - rb.loc[seeds, m].astype(float)) * 100
            row[f"{m}_a"] = float(ra.loc[seeds, m].mean() * 100)
            row[f"{m}_b"] = float(rb.loc[seeds, m].mean() * 100)
            row[f"d_{m}"] = float(d.mean())
            row[f"d_{m}_std"] = float(d.std(ddof=1)) if len(d) > 1 else math.nan
            row[f"{m}_wins"] = int((better * d > 0).sum())
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--csv", default=None)
    a = p.parse_args()
    frames = [pd.read_csv(f) for f in sorted(Path(a.results).glob("fedgp_*/summary/runs.csv"))]
    if not frames:
        raise SystemExit(f"no results/fedgp_*/summary/runs.csv under {a.results!r}: run the FedGP configs first")
    runs = pd.concat(frames, ignore_index=True)
    rows = [r for claim, exp, x, y in PAIRS for r in compare(runs, claim, exp, x, y)]
    table = pd.DataFrame(rows)
    for claim, g in table.groupby("claim", sort=False):
        n, won = len(g), int((g["d_acc"] > 0).sum())
        print(f"\n## {claim}: ACC higher in {won} of {n} comparisons")
        for _, r in g.iterrows():
            print(
                f"  {r['dataset']:24s} {r['a']:>22s} vs {r['b']:<22s} "
                f"ACC {r['acc_a']:5.1f} vs {r['acc_b']:5.1f} ({r['d_acc']:+5.1f} ± {r['d_acc_std']:4.1f}, {r['acc_wins']}/{r['seeds']} seeds)  "
                f"Fgt {r['fgt_a']:5.1f} vs {r['fgt_b']:5.1f} ({r['d_fgt']:+5.1f} ± {r['d_fgt_std']:4.1f}, lower on {r['fgt_wins']}/{r['seeds']})"
            )
    if a.csv:
        table.to_csv(a.csv, index=False)


if __name__ == "__main__":
    main()
