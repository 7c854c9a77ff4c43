"""The stand-in ``python`` of benchmarks/gpu_rehearsal.sh: each benchmark command of gpu.sh,
rewritten to run to its end on a CPU at toy sizes, then run by the real interpreter.

``rewrite`` is what it changes (tests/test_device.py parses every rewritten gpu.sh command
with its script's own argument parser); the numbers such runs print are not measurements.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulation  # noqa: E402  (benchmarks/simulation.py: its presets)

# [D] a GPU preset's 50,000 rows would take hours a command on 2 cores: blobs presets of the
# default size get 6000 training and 1000 test rows (ResNet-18's 100 clients, 60 rows each),
# the ViT-B/16 at 224 px 60 and 10 (its 5 clients at the partition's min_size of 10 and up:
# about 4 minutes for its three modes, the batched one's peak 18 GB of host memory:
# results/cpu-2026-12-05/gpu-rehearsal-b/vit-joined); those that state their size (resnet8:
# 4000 rows) keep it
TRAIN_ROWS = {"vit": 60}
SMALL = sorted(k for k, p in simulation.PRESETS.items() if p["dataset"] == "blobs" and "num_train" not in p["options"])
RESIZED = ("simulation.py", "profile_round.py", "packing.py", "process_memory.py")  # the scripts with --train-rows
CAPS = {"--rounds": 1, "--seconds": 3, "--budget": 40, "--steps": 2, "--iters": 2, "--samples": 1}
# [D] model_rates.py (sections hf, rates): 2 clients and 64 timed test rows. Its 10 clients' batched
# TinyBERT passed this machine's 24 GB of host memory (cpu-2026-12-05: killed); with 2 of them and its
# 2,048 test rows, --only hf took 11 minutes, peak 15.7 GB (results/cpu-2026-12-07-b/README.md)
SET = {"model_rates.py": {"--clients": "2", "--eval-rows": "64"}}


def is_benchmark(argv: list[str]) -> bool:
    """Whether a command runs a script of benchmarks/."""
    return bool(argv) and argv[0].endswith(".py") and "/benchmarks/" in argv[0]


def option(argv: list[str], key: str, default: str | None = None) -> str | None:
    """The value a command gives ``key`` (``--key value``), or ``default``."""
    return argv[argv.index(key) + 1] if key in argv else default


def rewrite(argv: list[str]) -> list[str]:
    """A benchmark command (script path, then its arguments) as the rehearsal runs it: on the
    CPU, 1 timed round, at most 2 warm-up rounds (packing.py: 1; profile_round.py on a task
    stream: 3), 3 timed seconds, a budget of
    40 s, 2 steps, 2 L-BFGS steps of 1 reconstruction (recon_cost.py), a simulation's --clients and --rate 40 and 0.25,
    model_rates.py's --clients 2 and --eval-rows 64 (``SET``), and --train-rows 6000 (vit:
    60) for the scripts that take it on a small blobs preset; any other command unchanged."""
    if not is_benchmark(argv):
        return list(argv)
    name, out, it = os.path.basename(argv[0]), [argv[0]], iter(argv[1:])
    # profile_round.py on a task stream times and profiles its rounds within task 1, which
    # must hold more warm-up rounds than twice the timed ones (1 here)
    continual_profile = name == "profile_round.py" and option(argv, "--tasks", "1") != "1"
    for x in it:
        if x == "--device":
            next(it)
            out += [x, "cpu"]
        elif x in CAPS:
            next(it)
            out += [x, str(CAPS[x])]
        elif x == "--warmup":
            n = int(next(it))
            out += [x, str(1 if name == "packing.py" else min(n, 3 if continual_profile else 2))]
        elif x == "--clients" and name == "simulation.py":
            next(it)
            out += [x, "40"]
        elif x == "--rate" and name == "simulation.py":
            next(it)
            out += [x, "0.25"]
        elif x in SET.get(name, {}):
            next(it)
        else:
            out.append(x)
    for key, value in SET.get(name, {}).items():
        out += [key, value]
    preset = option(argv, "--preset", "mcmahan")  # the scripts' default
    if name in RESIZED and preset in SMALL:
        out += ["--train-rows", str(TRAIN_ROWS.get(preset, 6000))]
    return out


def command_env(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment of a command: gpu.sh's GPU tests (``python -m pytest``, with
    FEDFORGET_TEST_DEVICE=cuda) run on the CPU along a GPU's code paths
    (FEDFORGET_TEST_GPU_PATHS=1, tests/conftest.py); any other command's unchanged."""
    if argv[:2] == ["-m", "pytest"]:
        return {**env, "FEDFORGET_TEST_DEVICE": "cpu", "FEDFORGET_TEST_GPU_PATHS": "1"}
    return env


def stand_in(real: str, log: str) -> None:
    """Rewrite this process's command, note it in ``log`` (a benchmark's only), run it."""
    argv = rewrite(sys.argv[1:])
    if is_benchmark(argv):
        with open(log, "a") as f:
            f.write(" ".join(argv) + "\n")
    os.execve(real, [real, *argv], command_env(argv, dict(os.environ)))
