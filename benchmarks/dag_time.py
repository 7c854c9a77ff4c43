"""How long Snakemake takes to build the DAG of the paper-scale table configs (issue 17, item
4: "all together build their DAG in at most 15 s").

For every config (default: ``config/experiments/paper/*.yaml``) it times the dry run
``snakemake -n --configfile <config>`` twice in a scratch working directory (a copy of
``config/``, so ``config/paper_results.csv`` resolves and no result of this checkout is
touched):

* **cold**: with an empty parse cache (``.snakemake/fedforget/`` removed), so the workflow's
  parse-time work runs from scratch: the config is validated (schema, registries, sizes;
  this imports torch) and each training job's code digest computed, and the result is
  written to the cache (``fedforget.parsecache``);
* **warm**: the same command again: the parse is loaded from the cache (no torch import);
  Snakemake still builds the job DAG from scratch, which is most of the time for large
  configs.

The cache keeps the 8 most recent parses (``parsecache.KEEP``); each config's warm run follows
its own cold run, so it always hits. The cache is written only where ``.snakemake/`` already
exists (a Snakemake working directory): in a directory where Snakemake never ran, the first
two calls both validate. ``.snakemake/`` is therefore kept between the runs here (only its
``fedforget/`` part is removed for a cold run).

"All together": ``snakemake --configfile a.yaml b.yaml`` does not add the files' experiments
up (each file updates the top-level keys, so the last ``experiments`` list wins), so the
configs are merged into one file whose ``experiments`` list is the concatenation (their
experiment names are distinct), as ``tests/test_workflow.py`` does for the shipped configs,
and that file is timed cold and warm; the sum of the per-config times is printed beside it.

Times are wall-clock seconds of the whole ``snakemake`` process (Python start, imports,
parse, DAG, the dry run's job listing) and, in brackets, its CPU seconds (user + sys, from
``getrusage`` of the child), which depend less on other load on the machine. The load
average before and after is printed: on a shared machine wall times vary with it.

    python benchmarks/dag_time.py                      # every paper config, then all together
    python benchmarks/dag_time.py --configs config/experiments/paper/fedsol_table2.yaml
    python benchmarks/dag_time.py --json dag_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET_S = 15.0  # issue 17, item 4


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = str(BIN) + os.pathsep + e.get("PATH", "")
    return e


def run(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall s, child CPU s, stdout + stderr) of one command; raises on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return wall, cpu, out


def job_counts(text: str) -> dict[str, int]:
    stats = text.split("Job stats:")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def dry_run(workdir: Path, configfile: Path, cores: int) -> tuple[float, float, dict[str, int]]:
    cmd = ["snakemake", "-s", str(REPO / "Snakefile"), "-n", "--cores", str(cores),
           "--quiet", "rules", "--configfile", str(configfile)]  # fmt: skip
    wall, cpu, out = run(cmd, workdir)
    return wall, cpu, job_counts(out)


def cold_warm(workdir: Path, configfile: Path, cores: int) -> dict:
    shutil.rmtree(workdir / ".snakemake" / "fedforget", ignore_errors=True)  # no parse cache: cold
    (workdir / ".snakemake").mkdir(exist_ok=True)  # where the parse cache may be written
    cw, cc, jobs = dry_run(workdir, configfile, cores)
    ww, wc, _ = dry_run(workdir, configfile, cores)
    return {"cold_wall_s": cw, "cold_cpu_s": cc, "warm_wall_s": ww, "warm_cpu_s": wc,
            "train_jobs": jobs.get("train", 0), "jobs": jobs.get("total", 0)}  # fmt: skip


def fmt(r: dict, kind: str) -> str:
    return f"{r[f'{kind}_wall_s']:6.2f} ({r[f'{kind}_cpu_s']:5.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", type=Path,
                   default=sorted((REPO / "config" / "experiments" / "paper").glob("*.yaml")))  # fmt: skip
    p.add_argument(
        "--cores", type=int, default=1, help="snakemake --cores (a dry run executes nothing)"
    )
    p.add_argument("--no-merged", action="store_true", help="skip the all-together run")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    a = p.parse_args()
    if not a.configs:
        raise SystemExit("no configs given or found under config/experiments/paper/")

    load0 = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="fedforget-dag-"))
    try:
        shutil.copytree(REPO / "config", workdir / "config")
        base_wall, base_cpu, _ = run(["snakemake", "--version"], workdir)
        print(f"# {len(a.configs)} configs; snakemake -n --cores {a.cores} in {workdir}; "
              f"{os.cpu_count()} CPUs, load average {load0[0]:.2f}")  # fmt: skip
        print(
            f"# `snakemake --version` alone (Python start + imports): {base_wall:.2f} s ({base_cpu:.2f} s CPU)"
        )
        print("# seconds: wall (CPU); cold = no parse cache (validation), warm = parse cache hit")
        print(f"{'config':<34} {'train':>6} {'jobs':>6} {'cold s':>15} {'warm s':>15}")
        rows: dict[str, dict] = {}
        experiments: list[dict] = []
        for cfg in a.configs:
            r = cold_warm(workdir, cfg.resolve(), a.cores)
            rows[cfg.name] = r
            experiments += yaml.safe_load(cfg.read_text())["experiments"]
            print(
                f"{cfg.name:<34} {r['train_jobs']:>6} {r['jobs']:>6} {fmt(r, 'cold'):>15} {fmt(r, 'warm'):>15}"
            )
        total = {k: sum(r[k] for r in rows.values()) for k in next(iter(rows.values()))}
        print(f"{'sum of the above':<34} {total['train_jobs']:>6} {total['jobs']:>6} "
              f"{fmt(total, 'cold'):>15} {fmt(total, 'warm'):>15}")  # fmt: skip
        result: dict = {"configs": rows, "sum": total, "snakemake_version_s": base_wall}
        if not a.no_merged and len(a.configs) > 1:
            names = [e["name"] for e in experiments]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise SystemExit(
                    f"experiment names repeat across the configs: {dup}; they cannot be merged"
                )
            merged = workdir / "all_configs.yaml"
            merged.write_text(yaml.safe_dump({"experiments": experiments}, sort_keys=False))
            m = cold_warm(workdir, merged, a.cores)
            result["merged"] = m
            print(f"{'all together (one merged file)':<34} {m['train_jobs']:>6} {m['jobs']:>6} "
                  f"{fmt(m, 'cold'):>15} {fmt(m, 'warm'):>15}")  # fmt: skip
            ok = max(m["cold_wall_s"], m["warm_wall_s"]) <= TARGET_S
            print(f"# target: all together <= {TARGET_S:.0f} s: {'met' if ok else 'NOT met'} "
                  f"(cold {m['cold_wall_s']:.1f} s, warm {m['warm_wall_s']:.1f} s wall; "
                  f"{m['cold_cpu_s']:.1f} / {m['warm_cpu_s']:.1f} s CPU)")  # fmt: skip
        load1 = os.getloadavg()
        print(f"# load average after: {load1[0]:.2f}")
        result.update(load_before=load0[0], load_after=load1[0], cpus=os.cpu_count())
        if a.json:
            a.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
