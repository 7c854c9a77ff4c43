"""Config validation under bad input: every value a config can hold, replaced, must end in one
``FedForgetError`` (or be accepted), never in another exception (a TypeError from ``int(None)``,
an unhashable list in a ``set``): prints and writes counts, not a test.

Two modes over each config file (default: ``config/config.yaml`` and every shipped experiment
config), each variant through ``parse_config``, as ``fedforget validate`` and every Snakemake
run do before any job:

- ``mutate``: every leaf and every mapping or list (the file's every key path) replaced by each
  of ``BAD`` (None, strings, negative, zero, fractional and integral floats, lists, mappings,
  bools, a huge and an infinite number), and deleted;
- ``swap``: every string leaf replaced by each valid alternative (the registries' dataset,
  model, method and partition names; the schema's enum at that key), every bool flipped: the
  cross-checks between keys meet combinations no shipped config holds.

A crash site is (exception type, file, line) where the last frame raised; the first variant
that reached it is kept. Run from the repository root (one process per file, ``--jobs``)::

    python benchmarks/config_fuzz.py --out benchmarks/results/cpu-DATE/config_fuzz.json
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BAD: list[Any] = [None, "zz", -1, 0, 1.5, 2.0, [], {}, True, 10**12, float("inf"), [1, "a"], {"zz": 1}]
DELETE = object()


def key_paths(node: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every node below the root, parents before their children."""
    out = [(prefix, node)] if prefix else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out += key_paths(v, prefix + (k,))
    return out


def alternatives(path: tuple, value: Any) -> list[Any]:
    """The valid values other than ``value`` at ``path`` (swap mode)."""
    from fedforget.data import DATASETS
    from fedforget.methods import METHODS
    from fedforget.models import MODEL_DEFAULTS
    from fedforget.partition import PARTITIONERS
    from fedforget.validation import _schema_at

    if isinstance(value, bool):
        return [not value]
    if not isinstance(value, str):
        return []
    names = [p for p in path if isinstance(p, str)]
    last, parent = names[-1], (names[-2] if len(names) > 1 else "")
    if (last == "name" and parent == "datasets") or last == "dataset":
        found = DATASETS.names()
    elif last == "model" or (last == "name" and parent == "model"):
        found = list(MODEL_DEFAULTS)
    elif last == "name" and parent == "methods":
        found = METHODS.names()
    elif last == "scheme":
        found = PARTITIONERS.names()
    else:
        found = list((_schema_at(list(path)) or {}).get("enum", []))
    return [a for a in found if a != value]


def fuzz_file(args: tuple[str, list[str], str | None]) -> dict[str, Any]:
    """Every variant of one config file: their count, seconds and crash sites."""
    from fedforget.config import load_yaml
    from fedforget.parse import parse_config
    from fedforget.utils import FedForgetError

    name, modes, scale = args
    base = load_yaml(ROOT / name)
    if scale:
        base["scale"] = scale
    parse_config(copy.deepcopy(base))  # the file itself is valid
    t0 = time.perf_counter()
    variants, crashes = 0, {}
    for path, value in key_paths(base):
        tries = (BAD + [DELETE] if "mutate" in modes else []) + (alternatives(path, value) if "swap" in modes else [])
        for new in tries:
            raw = copy.deepcopy(base)
            node = raw
            for k in path[:-1]:
                node = node[k]
            if new is DELETE:
                del node[path[-1]]
            else:
                node[path[-1]] = new
            variants += 1
            try:
                parse_config(raw)
            except FedForgetError:
                pass
            except Exception as e:  # the point: any other exception is a crash site
                frame = traceback.extract_tb(e.__traceback__)[-1]
                site = f"{type(e).__name__} {Path(frame.filename).relative_to(ROOT / 'src')}:{frame.lineno}"
                crashes.setdefault(site, {"path": list(path), "value": "<deleted>" if new is DELETE else repr(new),
                                          "error": str(e)[:300]})  # fmt: skip
    return {"config": name, "variants": variants, "seconds": round(time.perf_counter() - t0, 1), "crashes": crashes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", help="config files relative to the repository root (default: every shipped one)")
    ap.add_argument("--modes", default="mutate,swap", help="comma-separated: mutate, swap")
    ap.add_argument("--scale", choices=["full", "smoke"], help="set every config's scale (default: as written)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args()
    configs = a.configs or ["config/config.yaml"] + sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "config" / "experiments").rglob("*.yaml")
    )
    modes = a.modes.split(",")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.jobs) as pool:
        files = list(pool.map(fuzz_file, [(c, modes, a.scale) for c in configs]))
    sites: dict[str, Any] = {}
    for f in files:
        for site, first in f["crashes"].items():
            sites.setdefault(site, {"config": f["config"], **first})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit,
        "modes": modes,
        "scale": a.scale or "as written",
        "bad_values": [repr(v) for v in BAD],
        "configs": len(files),
        "variants": sum(f["variants"] for f in files),
        "seconds": round(time.perf_counter() - t0, 1),
        "crash_sites": sites,
        "files": files,
    }
    print(f"{result['configs']} configs, {result['variants']:,} variants, {result['seconds']} s: {len(sites)} crash site(s)")
    for site, first in sites.items():
        print(f"  {site}  first: {first['config']} {first['path']} = {first['value']}: {first['error'][:120]}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
