"""Count a flaky test's failures: run one test N times (in batches) under pytest-xdist, beside
busy processes that load the machine as a full suite does, and write the counts as JSON.

    python benchmarks/repeat_test.py 'tests/methods/test_concurrent_clients.py::test_lanes_equal_one_after_another[scr]' \
        --times 150 --batches 3 --workers 2 --load 1 --out flake.json
    # the same test at an older commit (its src and tests), with the same plugin:
    git worktree add /tmp/old 20e6b77
    python benchmarks/repeat_test.py '<node id>' --source /tmp/old --times 150 --out flake-old.json

A flake seen once in a suite is a count, not an anecdote, only when both sides of a fix are
run the same way: this script is that way [D]. Each batch is one pytest process over the
test's ``times`` copies (``pytest_generate_tests`` below adds a ``repeat`` parameter, so xdist
spreads the copies over its workers as it spreads a suite's tests); ``--load K`` starts K
busy-looping processes for the batch's length (a loaded machine schedules threads late: the
lanes' flake of 2026-12-06 needed it); ``--env K=V`` sets variables for the tests (e.g.
``FEDFORGET_TEST_GPU_PATHS=1``: a GPU's code paths on a CPU, batches alternating with
``--alternate-env``). Outcomes are read from pytest's JUnit XML, one per copy. A node id
without parameters (``file::test_f``) repeats each of the function's parameters, a file's
(``file``) or a folder's (``tests/methods``) each of its tests, counted per test
(``failed_by_test``): a hunt over a contract test's every method. ``-m`` selects as pytest's
does (default ``not long``, the suite's).

This file is also the pytest plugin that makes the copies (``-p repeat_test``, found on
PYTHONPATH); the plugin does nothing unless ``--repeat-times`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPEAT_PART = re.compile(r"\[repeat\d+\]$|(?<=\[)repeat\d+-|-repeat\d+(?=[-\]])")


# ---------------------------------------------------------------------- the pytest plugin
def pytest_addoption(parser):
    parser.addoption("--repeat-times", type=int, default=0, help="run each selected test this many times")
    parser.addoption("--repeat-only", default="", help="keep only the copies of this node id")


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("--repeat-times")
    if n > 0:
        metafunc.fixturenames.append("_repeat")
        metafunc.parametrize("_repeat", range(n), ids=[f"repeat{i}" for i in range(n)])


def base_id(nodeid: str) -> str:
    """A copy's node id without its repeat part (pytest puts it among the other parameters'
    ids by fixture order): ``f[repeat3-scr]``, ``f[scr-repeat3]`` -> ``f[scr]``; ``f[repeat3]`` -> ``f``."""
    return REPEAT_PART.sub("", nodeid, count=1)


def pytest_collection_modifyitems(config, items):
    only = config.getoption("--repeat-only")
    if only:
        # a node id without parameters keeps every parameter's copies (each counted on its own), a
        # file's, a class's or a folder's every test's
        within = (only + "[", only + "::", only.rstrip("/") + "/")
        ok = [(b := base_id(it.nodeid)) == only or b.startswith(within) for it in items]
        config.hook.pytest_deselected(items=[it for it, k in zip(items, ok) if not k])
        items[:] = [it for it, k in zip(items, ok) if k]


# ---------------------------------------------------------------------- the runner
def outcomes(xml: Path) -> dict[str, str]:
    """Each test case's outcome (passed / failed / error / skipped) from JUnit XML."""
    tags = {"failure": "failed", "error": "error", "skipped": "skipped"}  # JUnit's child tag -> outcome
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        out[f"{case.get('classname')}::{case.get('name')}"] = next((v for k, v in tags.items() if k in kinds), "passed")
    return out


def git_commit(path: Path) -> str | None:
    """The commit checked out at ``path`` (``--source``: not the package's own, as provenance's), or None."""
    r = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def parse_env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"--env {p!r}: expected NAME=VALUE")
        k, v = p.split("=", 1)
        out[k] = v
    return out


def run_batch(args, source: Path, env_extra: dict[str, str], tmp: Path, index: int) -> dict:
    function = re.sub(r"\[.*\]$", "", args.test)  # collect the function; the plugin keeps the id's copies
    xml = tmp / f"batch{index}.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(source / "src"), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(env_extra)
    cmd = [sys.executable, "-m", "pytest", function, "-p", "repeat_test", "-p", "no:cacheprovider", "-q",
           f"--repeat-times={args.times}", f"--repeat-only={args.test}", f"--junitxml={xml}", "-o",
           "junit_family=xunit1"]  # fmt: skip
    if args.marker:
        cmd += ["-m", args.marker]
    if args.workers > 0:
        cmd += ["-n", str(args.workers), "--dist", "worksteal"]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    wall = time.perf_counter() - t0
    if not xml.exists():
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"batch {index}: pytest wrote no report (exit {r.returncode})")
    res = outcomes(xml)
    if not res:
        sys.stderr.write(r.stdout[-3000:])
        raise SystemExit(f"{args.test!r}: no test of that node id was collected in {source}")
    counts = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "error", "skipped")}
    failed = sorted(n.rsplit("::", 1)[-1] for n, v in res.items() if v in ("failed", "error"))
    return {
        "env": env_extra,
        **counts,
        "runs": len(res),
        "failed_copies": failed,
        "failed_by_test": dict(sorted(Counter(base_id(c) for c in failed).items())),
        "wall_s": round(wall, 1),
        "pytest_exit": r.returncode,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test", help="the test's node id, relative to --source (e.g. tests/x.py::test_f[a]; "
                    "tests/x.py::test_f, tests/x.py, tests/methods: each of their tests)")  # fmt: skip
    ap.add_argument("--times", type=int, default=100, help="copies per batch")
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0: none)")
    ap.add_argument("--load", type=int, default=1, help="busy-looping processes beside each batch")
    ap.add_argument("--source", default=str(HERE.parent), help="the checkout whose src/ and tests/ run")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for every batch")
    ap.add_argument("--alternate-env", action="append", default=[],
                    help="NAME=VALUE for every second batch (the 2nd, 4th, ...)")  # fmt: skip
    ap.add_argument("-m", dest="marker", default="not long", help="pytest's marker expression ('': every test)")
    ap.add_argument("--out", help="JSON file to write (default: stdout only)")
    args = ap.parse_args(argv)
    for key in ("times", "batches"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key}={getattr(args, key)}: must be >= 1")
    if args.workers < 0 or args.load < 0:
        raise SystemExit("--workers and --load must be >= 0")
    env, alt = parse_env(args.env), parse_env(args.alternate_env)
    source, path = Path(args.source).resolve(), args.test.split("::", 1)[0]
    if not (source / path).exists():
        raise SystemExit(f"{args.test!r}: no file {path} in --source {source}")
    batches = []
    with tempfile.TemporaryDirectory(prefix="repeat_test_") as tmp:
        for i in range(args.batches):
            batch = run_batch(args, source, {**env, **(alt if i % 2 else {})}, Path(tmp), i)
            batches.append(batch)
            print(f"batch {i}: {batch['failed'] + batch['error']} of {batch['runs']} failed, {batch['wall_s']} s", flush=True)
    import torch  # the versions beside the counts

    out = {
        "test": args.test,
        "source": str(source),
        "source_commit": git_commit(source),
        "times": args.times,
        "workers": args.workers,
        "load": args.load,
        "marker": args.marker,
        "batches": batches,
        "total": {
            "runs": sum(b["runs"] for b in batches),
            "failed": sum(b["failed"] + b["error"] for b in batches),
            "failed_by_test": dict(sorted(sum((Counter(b["failed_by_test"]) for b in batches), Counter()).items())),
        },
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},  # fmt: skip
        "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(f"{out['total']['failed']} of {out['total']['runs']} runs failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
