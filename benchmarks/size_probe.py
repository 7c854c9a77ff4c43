"""Well-typed but huge sizes, run: each integer hyperparameter of every registered method
(those without a maximum) set to 10**12, every integer of the config schema without a
maximum (train, partition, scenario, augmentation and smoke sizes: ``schema_cases``) at
10**12, a model width at 10**12, a seed of 2**64 and the embedded datasets' size options at
their maxima (``DATASET_CASES``), each a whole pipeline run (``fedforget run``) on a tiny
config. Validation checks types and ranges, not whether a size
fits a machine, so these pass it; what a user then needs is a run that completes (the size
means "all": full-batch training, a memory batch of the whole buffer, a buffer that keeps
every row) or one error naming the value (``fedforget: error:``), never a traceback. Prints
and writes counts, not a test (``config_fuzz.py`` is its validation-time sibling).

Each case is a subprocess with a time limit (a size that means "more work", ``rounds`` or
``epochs`` 10**12, runs on: "long", accepted). Outcomes: ``completed``, ``error`` (one
``fedforget: error:`` line), ``long``, ``crash`` (anything else: its exception and the last
``src/fedforget`` frame are the crash site, or the signal that killed it). The config: iris (a 10 % public holdout), an MLP,
Dirichlet 0.5 over 4 clients, 3 of them a round, 2 rounds, on the CPU; a method defined on a
ViT alone (L2P) on digits with a 1-layer ViT. Run from the repository root::

    python benchmarks/size_probe.py --out benchmarks/results/cpu-DATE/size_probe.json
    python benchmarks/size_probe.py --src /path/to/old/checkout/src ...   # another commit
    python benchmarks/size_probe.py --value 18446744073709551616 ...       # 2**64: beyond 64 bits
    python benchmarks/size_probe.py --numbers ...                          # real numbers at 1e300, 3e38, 1e-300
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from fedforget.utils import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
HUGE = 10**12
# small settings of the slow methods, so that a case that completes does so in seconds (a
# probed field overrides them)
FAST = {
    "glfc": {"perturb_iters": 2, "recon_iters": 2, "recon_inner": 2, "recon_keep": 2},
    "lga": {"perturb_iters": 2, "recon_iters": 2, "recon_inner": 2, "recon_keep": 2},
    "scr": {"views": "dataset"},
}
# (dataset, option, value): the embedded datasets' integer size options at the maxima their
# checks allow, and a subset beyond every class (all rows)
DATASET_CASES = [("blobs", "num_train", 10**9), ("blobs", "num_test", 10**9), ("blobs", "channels", 4096),
                 ("blobs", "size", 4096), ("mnist1d", "num_samples", 10**9), ("iris", "subset", 10**12)]  # fmt: skip
TINY_VIT = {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}


def cases(huge: int = HUGE) -> list[dict[str, Any]]:
    """(name, method, params, train, model options, seeds) of every case."""
    from fedforget.methods import METHODS
    from fedforget.methods.params import SCHEMA

    out = [
        *schema_cases(huge),
        {"name": "model.options.hidden", "model_options": {"hidden": [huge]}},
        {"name": "seeds", "seeds": [2**64]},
        *({"name": f"dataset.{d}.{k}", "dataset": {"name": d, "options": {k: v}}} for d, k, v in DATASET_CASES),
    ]
    for m in METHODS.names():
        for f in dataclasses.fields(METHODS.get(m).Params):
            s = f.metadata.get(SCHEMA, {})
            if s.get("type") == "integer" and "maximum" not in s:
                out.append({"name": f"{m}.{f.name}", "method": m, "params": {f.name: huge}})
    return out


# a task stream over iris's 3 classes, one round a task (the scenario cases' base)
SPLIT = {"kind": "split", "tasks": 3, "classes_per_task": 1, "rounds_per_task": 1}


def schema_fields(kind: str) -> list[tuple[list[str], dict[str, Any]]]:
    """Each field of the config schema of JSON type ``kind`` ("integer", "number"): its path
    (the names of the mappings it is in, ``$defs`` and the like left out) and its schema."""
    schema = yaml.safe_load((ROOT / "src/fedforget/schemas/config.schema.yaml").read_text())
    found: list[tuple[list[str], dict[str, Any]]] = []

    def walk(node: Any, path: list[str]) -> None:
        if isinstance(node, dict):
            if node.get("type") == kind:
                found.append((path, node))
            for k, v in node.items():
                walk(v, path if k in ("properties", "$defs", "items", "oneOf") else [*path, k])
        elif isinstance(node, list):
            for v in node:
                walk(v, path)

    walk(schema, [])
    return found


def schema_cases(huge: int = HUGE) -> list[dict[str, Any]]:
    """A case for each integer of the config schema without a maximum (but the seed, its own
    case, and a paper table's number, a label), set where a config reads it: a train key, a
    partition key under the scheme that reads it, a scenario key in a split of iris (a
    boundary in asynchronous windows), the augmentation's pad on digits, a smoke key at
    scale smoke."""
    from fedforget.partition import SCHEME_KEYS

    out = []
    for parts, node in schema_fields("integer"):
        if "maximum" in node:
            continue
        key = parts[-1]
        if parts[0] == "train":
            train = {key: [huge] if key == "save_client_models" else huge}
            out.append({"name": f"train.{key}", "train": train})
        elif parts[0] == "partition":
            scheme = next((s for s, keys in SCHEME_KEYS.items() if key in keys), "dirichlet")
            out.append({"name": f"partition.{key}", "partition": {"scheme": scheme, key: huge}})
        elif parts[0] == "scenario":
            scenario = ({**SPLIT, "boundaries": {"samples_per_window": 10, "window_rounds": 1, key: huge}}
                        if parts[1] == "boundaries" else {**SPLIT, key: huge})  # fmt: skip
            out.append({"name": f"scenario.{'.'.join(parts[1:])}", "scenario": scenario, "train": {"rounds": 3}})
        elif parts[:2] == ["dataset", "augment"]:
            out.append({"name": f"augment.{key}", "dataset": {"name": "digits"}, "augment": {"kind": "crop_flip", key: huge}})
        elif parts[0] == "smoke":
            out.append({"name": f"smoke.{key}", "smoke": {key: huge}})
        elif parts[0] not in ("seed", "experiment"):  # (the seed's case is "seeds"; paper.table is a label)
            raise ValueError(f"size_probe: no case for the schema's {'.'.join(parts)}")
    return out


VAST, BIG, TINY = 1e300, 3e38, 1e-300  # beyond float32; within it (its largest is 3.4e38); near 0
# uint8 images (what dataset.normalize applies to), small
UINT8_BLOBS = {"name": "blobs", "options": {"num_train": 200, "num_test": 50, "size": 8, "uint8": True}}


def extremes(s: dict[str, Any]) -> list[float]:
    """The extreme values a number's schema allows: 1e300 and 3e38 without a maximum, 1e-300
    above an exclusive minimum of 0."""
    unbounded = "maximum" not in s and "exclusiveMaximum" not in s
    return [v for v, ok in ((VAST, unbounded), (BIG, unbounded), (TINY, s.get("exclusiveMinimum") == 0)) if ok]


def number_cases() -> list[dict[str, Any]]:
    """``--numbers``: every real-valued method hyperparameter and config number at the extremes
    its schema allows (``extremes``): a run may diverge (its status says so) or end in one
    error, never in a traceback."""
    from fedforget.methods import METHODS
    from fedforget.methods.params import SCHEMA

    out = []
    for m in METHODS.names():
        for f in dataclasses.fields(METHODS.get(m).Params):
            s = f.metadata.get(SCHEMA, {})
            if s.get("type") == "number":
                out += [{"name": f"{m}.{f.name}={v:g}", "method": m, "params": {f.name: v}} for v in extremes(s)]
    for parts, node in schema_fields("number"):
        key, name = parts[-1], ".".join(parts)
        for v in extremes(node):
            if parts[0] == "train":
                case = {"train": {key: v}}
            elif parts[0] == "optimizer":
                case = {"train": {"optimizer": {"name": "sgd", "lr": 0.1, key: v}}}
            elif parts[0] == "partition":
                case = {"partition": {"scheme": "dirichlet", key: v}}
            elif parts[:2] == ["dataset", "public"]:
                case = {"public": {"source": "holdout", "fraction": v, "seed": 0}}
            elif parts[:2] == ["dataset", "normalize"]:
                case = {"dataset": UINT8_BLOBS, "normalize": {"mean": [0.5], "std": [v]}}
            else:
                raise ValueError(f"size_probe: no case for the schema's {name}")
            out.append({"name": f"{name}={v:g}", **case})
    return out


def config(case: dict[str, Any], data: Path, results: Path) -> dict[str, Any]:
    from fedforget.methods import METHODS
    from fedforget.partition import SCHEME_KEYS

    m = case.get("method", "fedavg")
    vit = getattr(METHODS.get(m), "needs_model", None) == "vit"
    ds = ({"name": "digits", "model": {"name": "vit", "options": TINY_VIT}} if vit else
          {"name": "iris", "model": {"name": "mlp", "options": case.get("model_options", {})},
           "public": {"source": "holdout", "fraction": 0.1, "seed": 0}})  # fmt: skip
    if "dataset" in case:
        ds = {**case["dataset"], "model": {"name": "mlp"}}
    ds.update({k: case[k] for k in ("scenario", "augment", "public", "normalize") if k in case})
    partition = {"scheme": "dirichlet", "alpha": 0.5, "clients": 4, "min_size": 5, "seed": 0}
    if "partition" in case:  # the base keys the case's scheme reads, then the case's
        scheme = case["partition"]["scheme"]
        other = {k for s, keys in SCHEME_KEYS.items() if s != scheme for k in keys}
        partition = {**{k: v for k, v in partition.items() if k not in other}, **case["partition"]}
    train = {"rounds": 2, "local_epochs": 1, "batch_size": 16, "sample_rate": 0.75, "device": "cpu", "threads": 1,
             "optimizer": {"name": "sgd", "lr": 0.1}, **case.get("train", {})}  # fmt: skip
    smoke = {"scale": "smoke", "smoke": case["smoke"]} if "smoke" in case else {}
    return {
        "data_dir": str(data), "results_dir": str(results), **smoke,
        "experiments": [{
            "name": "probe", "datasets": [ds],
            "partitions": [partition],
            "methods": [{"name": m, "params": {**FAST.get(m, {}), **case.get("params", {})}}],
            "seeds": case.get("seeds", [0]), "train": train,
        }],
    }  # fmt: skip


def crash_site(stderr: str) -> str:
    """The exception's type and the last src/fedforget frame of a traceback."""
    frames = re.findall(r'File "([^"]*src/fedforget/[^"]*)", line (\d+)', stderr)
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    kind = last.split(":")[0] if ":" in last else last
    where = f"{frames[-1][0].split('src/')[-1]}:{frames[-1][1]}" if frames else "?"
    return f"{kind} {where}"


def run_case(case: dict[str, Any], work: Path, src: Path, limit: float) -> dict[str, Any]:
    path = work / f"{case['name']}.yaml"
    path.write_text(yaml.safe_dump(config(case, work / "data", work / f"results-{case['name']}")))
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "fedforget", "run", "--config", str(path)], env=env,
                           capture_output=True, text=True, timeout=limit)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"case": case["name"], "outcome": "long", "seconds": round(time.perf_counter() - t0, 1)}
    out = {"case": case["name"], "seconds": round(time.perf_counter() - t0, 1)}
    lines = p.stderr.strip().splitlines()
    if p.returncode == 0:  # (a diverged run is a result too: run.json's status says which)
        statuses = sorted({json.loads(f.read_text())["status"] for f in (work / f"results-{case['name']}").rglob("run.json")})
        return {**out, "outcome": "completed", "statuses": statuses}
    if p.returncode == 2 and "Traceback" not in p.stderr and "fedforget: error:" in p.stderr:
        return {**out, "outcome": "error", "message": p.stderr[p.stderr.index("fedforget: error:"):].strip()[:400]}
    # (a negative return code: killed by that signal, e.g. 9 by the kernel's out-of-memory killer)
    site = f"killed by signal {-p.returncode}" if p.returncode < 0 else crash_site(p.stderr)
    return {**out, "outcome": "crash", "site": site, "message": (lines[-1] if lines else "")[:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(ROOT / "src"), help="the fedforget source to run (default: this checkout's)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds per case before it counts as long")
    ap.add_argument("--only", help="a regular expression on case names")
    ap.add_argument("--value", type=int, default=HUGE, help="the huge value (default 10**12; 2**64: beyond 64 bits)")
    ap.add_argument("--numbers", action="store_true", help="real numbers at their extremes instead (number_cases)")
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args()
    src = Path(a.src).resolve()
    all_cases = [c for c in (number_cases() if a.numbers else cases(a.value)) if not a.only or re.search(a.only, c["name"])]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="size_probe-") as tmp:
        work = Path(tmp)
        # the data prepared once, before the cases share them
        first = run_case({"name": "prepare"}, work, src, 600)
        if first["outcome"] != "completed":
            raise SystemExit(f"the base config did not run: {first}")
        for base in ({"name": "prepare-vit", "method": "l2p"}, {"name": "prepare-uint8", "dataset": UINT8_BLOBS}):
            done = run_case(base, work, src, 600)
            if done["outcome"] != "completed":
                raise SystemExit(f"the base config {base['name']} did not run: {done}")
        with ThreadPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(lambda c: run_case(c, work, src, a.limit), all_cases))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True).stdout.strip()
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("completed", "error", "long", "crash")}
    counts["diverged"] = sum("diverged" in r.get("statuses", ()) for r in rows)  # of the completed
    sites = sorted({r["site"] for r in rows if r["outcome"] == "crash"})
    result = {"commit": commit, "value": [VAST, BIG, TINY] if a.numbers else a.value, "limit_s": a.limit, "cases": len(rows), **counts,
              "crash_sites": sites, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}  # fmt: skip
    print(report(result))
    if a.out:
        atomic_write_json(a.out, result)


def report(result: dict[str, Any]) -> str:
    """The counts, then each case that ended in an error or a crash, one line each."""
    counts = ", ".join(f"{result[k]} {k}" for k in ("completed", "error", "long", "crash"))
    counts += f" ({result.get('diverged', 0)} of the completed diverged)"
    lines = [f"{result['commit'][:7]}: {result['cases']} cases in {result['seconds']} s: {counts}"]
    lines += [f"  {r['outcome']:5} {r['case']}: {r.get('site', '')} {r['message'][-160:]}"
              for r in result["rows"] if r["outcome"] in ("crash", "error")]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
