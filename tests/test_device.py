"""Where a job runs (issue 18, item 4): `device: auto` takes the GPU a scheduler gives the job
(CUDA_VISIBLE_DEVICES is torch's business: it numbers the visible GPUs from 0), run.json
records the host, the GPU and the SLURM job, and a GPU picks the batched client engine. No
GPU here: CUDA is faked where torch would be asked about it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from fedforget.engine import resolve_device
from fedforget.runner import run_training, where_it_runs
from fedforget.utils import FedForgetError
from fedforget.vectorized import auto_prefers_sequential

from .conftest import SMALL_RESNET, benchmark_script


@pytest.fixture
def sim():
    """benchmarks/simulation.py, loaded as a module."""
    with benchmark_script("simulation") as module:
        yield module


def test_auto_is_cuda_when_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(FedForgetError, match="train.device='cuda:1' but no CUDA device"):
        resolve_device("cuda:1")


def test_a_device_this_machine_lacks_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """An index beyond the machine's GPUs, or MPS where there is none: one error naming the
    value and what this machine allows (a raw CUDA error at the first tensor before)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(FedForgetError, match=r"train.device='cuda:2' but this machine has 2 CUDA device\(s\); allowed: auto, cpu, cuda, cuda:0, cuda:1$"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(FedForgetError, match="train.device='mps' but no MPS device is available"):
        resolve_device("mps")


def test_a_gpu_trains_clients_batched_where_stacked_forward_runs_the_model() -> None:
    stacked = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU())
    assert auto_prefers_sequential(stacked, torch.device("cuda")) is None
    vmap_only = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.PReLU())
    why = auto_prefers_sequential(vmap_only, torch.device("cuda"))
    assert why == "auto on a GPU: sequential (module PReLU would need the vmap path, slower than a loop on a GPU)"
    normed = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4))  # stacked: batched on a GPU
    assert auto_prefers_sequential(normed, torch.device("cuda")) is None
    why = auto_prefers_sequential(normed, torch.device("cpu"))
    assert why == "auto on a CPU: sequential (module GroupNorm: the stacked ResNet step is measured on a GPU only)"


def test_run_json_records_the_gpu_and_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"NVIDIA H100 ({d})")
    host = where_it_runs(torch.device("cuda:0"))
    assert host["cuda_visible_devices"] == "3" and host["gpu"] == "NVIDIA H100 (cuda:0)"
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:  # the flags as they are when the run trains (PyTorch's defaults: convolutions yes, matmul no)
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, True
        assert where_it_runs(torch.device("cuda:0"))["tf32"] == {"cudnn_conv": False, "matmul": True}
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
    assert host["slurm_job_id"] == "4242" and host["slurm_job_partition"] == "gpu"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert "slurm_job_id" not in where_it_runs(torch.device("cpu"))
    assert "gpu" not in where_it_runs(torch.device("cpu"))


def test_a_cpu_run_records_its_host(tmp_path, make_run_config, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    run_training(make_run_config(device="cpu"), tmp_path / "run", progress=False)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["device"] == "cpu" and record["host"]["slurm_job_id"] == "77"
    assert record["host"]["hostname"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (benchmarks/gpu.sh runs this where one is)")
def test_a_run_on_a_real_gpu_uses_it_batched_and_records_it(tmp_path, make_run_config) -> None:
    """On a GPU node: `device: auto` trains on the GPU torch sees first (what
    CUDA_VISIBLE_DEVICES left visible), with the batched client engine, and says so."""
    run_training(make_run_config(device="auto", client_engine="auto"), tmp_path / "run", progress=False)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["device"].startswith("cuda")
    assert record["host"]["gpu"] == torch.cuda.get_device_name(0)
    assert record["client_engine"] == "vectorized"


def test_warming_every_minibatch_size_changes_no_result(make_run_config, monkeypatch) -> None:
    """The sequential trainer's up-front pass over every minibatch size (on a GPU: cuDNN's
    kernels chosen before the rounds, trainers.warm_conv_shapes), forced here on the CPU:
    the run's metrics and weights are the bits of a run without it, and it met each size
    1..batch_size once, on a twin of the model."""
    import fedforget.trainers as tr
    from fedforget.engine import TIMING_COLUMNS, Simulation

    rc = make_run_config(dataset="digits", model="resnet8", model_options=SMALL_RESNET, rounds=1, batch_size=16, client_engine="sequential", drop_last=True,
                         sample_rate=0.5,
                         optimizer={"lr": 0.05, "momentum": 0.9})  # fmt: skip
    runs, seen = {}, []
    real = tr.warm_conv_shapes

    def spy(model, row, sizes, autocast):
        seen.append((list(sizes), tuple(row.shape)))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        n = real(model, row, sizes, autocast)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert torch.equal(rng, torch.get_rng_state()) and all(p.grad is None for p in model.parameters())
        return n

    monkeypatch.setattr(tr, "warm_conv_shapes", spy)
    for warm in (False, True):
        monkeypatch.setattr(tr, "conv_warmup_wanted", lambda model, device, warm=warm: warm)
        sim = Simulation(rc)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        runs[warm] = (sim, [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows])
    assert seen == [(list(range(1, 17)), (1, 1, 8, 8))]
    assert runs[False][1] == runs[True][1]
    assert all(torch.equal(v, runs[True][0].global_params[k]) for k, v in runs[False][0].global_params.items())


def test_gpu_script_runs_each_of_its_sections(repo_root, tmp_path) -> None:
    """benchmarks/gpu.sh, the one script a GPU session runs: every section it defines is one
    its dispatcher runs, and its default ORDER names only those (a section left out of the
    dispatcher is skipped as unknown, and its numbers are lost for that session)."""
    import re

    text = (repo_root / "benchmarks" / "gpu.sh").read_text()
    defined = set(re.findall(r"^(\w+)\(\) \{", text, re.M)) - {"box"}
    (dispatched,) = re.findall(r'case " ([\w ]+) " in', text)
    (order,) = re.findall(r'^DEFAULT_ORDER="([\w ]+)"$', text, re.M)
    assert defined == set(dispatched.split())
    assert set(order.split()) == defined
    assert "ORDER=${ORDER:-${SECTIONS:-$DEFAULT_ORDER}}" in text
    # --default-order prints it and runs nothing (no results folder made); the CPU rehearsal
    # takes its order from there (the GPU tests on a GPU's code paths), not a copy of its own
    run = subprocess.run(["bash", str(repo_root / "benchmarks" / "gpu.sh"), "--default-order"], cwd=tmp_path,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.split() == order.split()
    assert not list(tmp_path.iterdir())  # no results folder, default or named --default-order
    rehearsal = (repo_root / "benchmarks" / "gpu_rehearsal.sh").read_text()
    (line,) = [ln for ln in rehearsal.splitlines() if ln.startswith("order=")]
    listed = sorted(defined & set(re.findall(r"\w+", line)))
    assert "gpu.sh\" --default-order" in line and not listed, line
    derived = subprocess.run(["bash", "-c", line.replace('$work/repo', str(repo_root)) + '; echo "$order"'],
                             capture_output=True, text=True, check=True, env={**os.environ, "ORDER": ""})
    assert derived.stdout.split() == order.split()


# a pytest plugin, for one process that imports torch once: at its start, each recorded
# benchmark command's argparse, run to its parse and no further (a GPU session is 15
# minutes: an argument typo there costs a section); then, over one collection of every file
# the recorded pytest calls name, how many tests each call's files and -k expression select
# (pytest's own -k matching)
_PLUGIN = """
import argparse, json, os, runpy, sys
from pathlib import Path
from _pytest.mark import KeywordMatcher
from _pytest.mark.expression import Expression

class Parsed(Exception):
    pass

def parse_only(self, args=None, namespace=None):
    ns, rest = self.parse_known_args(args, namespace)
    if rest:
        self.error("unrecognized arguments: " + " ".join(rest))
    raise Parsed

def pytest_configure(config):
    keep, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, parse_only
    argv, errors = sys.argv, []
    try:
        for script, args in json.loads(os.environ["GPU_SH_SCRIPTS"]):
            sys.argv = [script, *args]
            try:
                runpy.run_path(script, run_name="__main__")
                errors.append(f"{script}: ran past its argument parsing")
            except Parsed:
                pass
            except SystemExit as e:  # argparse's error, printed on stderr
                errors.append(f"{Path(script).name} {' '.join(args)}: exit {e.code}")
    finally:
        sys.argv, argparse.ArgumentParser.parse_args = argv, keep
    Path(os.environ["GPU_SH_PARSED"]).write_text(json.dumps(errors))

def pytest_collection_modifyitems(config, items):
    counts = []
    for files, expr in json.loads(os.environ["GPU_SH_SELECTIONS"]):
        paths = {str(Path(f).resolve()) for f in files}
        match = Expression.compile(expr) if expr else None
        counts.append(sum(1 for it in items if str(Path(it.path).resolve()) in paths
                          and (match is None or match.evaluate(KeywordMatcher.from_item(it)))))
    Path(os.environ["GPU_SH_COUNTS"]).write_text(json.dumps(counts))
"""


def test_gpu_script_commands_parse_and_select_tests(repo_root, tmp_path) -> None:
    """Every command benchmarks/gpu.sh runs, started as a device call starts it
    (benchmarks/gpu_device.sh), recorded by a stand-in ``python`` (nothing runs, no GPU
    needed): each benchmark script accepts its arguments (names, choices, types), as gpu.sh
    passes them and as its CPU rehearsal (benchmarks/gpu_rehearsal.py) rewrites them, and each
    pytest call's files and -k expression select tests (one collection, pytest's -k)."""
    import sys

    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    calls = tmp_path / "calls.jsonl"
    (stand_in / "python").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps([os.getcwd(), sys.argv[1:]]) + '\\n')\n"
    )
    (stand_in / "nvidia-smi").write_text("#!/bin/sh\necho stand-in\n")
    for f in stand_in.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_in}{os.pathsep}{os.environ['PATH']}", "BUDGET": "100000"}
    env.pop("ORDER", None)
    env.pop("SECTIONS", None)
    device = [str(repo_root / "benchmarks" / "gpu_device.sh")]  # gpu.sh as a device call starts it
    unset = subprocess.run(["bash", *device], env=env, capture_output=True, text=True, timeout=60)
    assert unset.returncode != 0 and "OUT: the folder a device call brings back" in unset.stderr
    env.update(OUT=str(tmp_path / "out"), WHEEL_DIR=str(tmp_path / "no-wheels"))
    done = subprocess.run(["bash", *device], env=env, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "unknown section" not in said, said
    assert "no-wheels/ carried" in done.stderr and "gpu.sh: " in (tmp_path / "out" / "log.txt").read_text()
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    scripts = [(argv[0], argv[1:]) for _, argv in recorded if argv and argv[0].endswith(".py")]
    assert len(scripts) > 20
    assert {Path(s).name for s, _ in scripts} >= {"simulation.py", "packing.py", "streaming.py", "model_rates.py"}
    with benchmark_script("gpu_rehearsal") as rehearsal:  # its CPU rehearsal's commands parse as well
        rehearsed = [rehearsal.rewrite([s, *a]) for s, a in scripts]
        own_size = [rehearsal.rewrite(["/r/benchmarks/simulation.py", "--preset", p]) for p in ("resnet8", "digits")]
        option = rehearsal.option
        # the GPU tests (gpu.sh: FEDFORGET_TEST_DEVICE=cuda python -m pytest ...) on a GPU's code paths on the CPU
        tests_env = rehearsal.command_env(["-m", "pytest", "-q", "tests/test_vectorized.py"], {"FEDFORGET_TEST_DEVICE": "cuda"})
        other_env = rehearsal.command_env(["/r/benchmarks/simulation.py"], {"FEDFORGET_TEST_DEVICE": "cuda"})
    assert tests_env == {"FEDFORGET_TEST_DEVICE": "cpu", "FEDFORGET_TEST_GPU_PATHS": "1"}
    assert other_env == {"FEDFORGET_TEST_DEVICE": "cuda"}
    assert all("cuda" not in argv for argv in rehearsed)
    resized = {Path(argv[0]).name for argv in rehearsed if "--train-rows" in argv}
    assert resized == {"simulation.py", "profile_round.py", "packing.py", "process_memory.py"}
    assert not [argv for argv in own_size if "--train-rows" in argv]  # resnet8 states its size; digits is no blobs
    # model_rates.py (hf, rates) at 2 clients and 64 test rows: 10 clients' batched TinyBERT passed 24 GB of host memory
    rates = [argv for argv in rehearsed if argv[0].endswith("model_rates.py")]
    assert rates and all(option(argv, "--clients") == "2" and option(argv, "--eval-rows") == "64" for argv in rates)
    assert all(argv.count("--clients") == 1 for argv in rates)
    vit = [argv for argv in rehearsed if option(argv, "--preset") == "vit"]
    assert vit and all(option(argv, "--train-rows") == "60" for argv in vit)  # 224 px on a CPU
    # profile_round.py refuses a task stream unless 2 x --rounds < --warmup
    profiles = [argv for argv in rehearsed if argv[0].endswith("profile_round.py") and "--tasks" in argv]
    assert profiles and all(2 * int(option(argv, "--rounds")) < int(option(argv, "--warmup")) for argv in profiles)
    scripts += [(argv[0], argv[1:]) for argv in rehearsed]
    selections = []  # (files, -k expression) of each pytest call, files from the repository root
    for cwd, argv in recorded:
        if argv[:2] != ["-m", "pytest"] or argv[2:] == ["--version"]:  # gpu.txt's version line
            continue
        files, expr, it = [], "", iter(argv[2:])
        for a in it:
            if a == "-k":
                expr = next(it)
            elif a in ("-n", "-p"):
                next(it)
            elif not a.startswith("-"):
                files.append(str(Path(cwd, a).resolve().relative_to(repo_root.resolve())))
        selections.append((files, expr))
    assert len(selections) >= 2
    # pytest 9.1.0/9.1.1 (the device image's) drops a subdirectory's conftest fixtures for its
    # files listed after a parent directory's file that follows one of them (pytest#14964):
    # sorted arguments keep each directory's files together
    assert [files for files, _ in selections if files != sorted(files)] == []

    (tmp_path / "gpu_sh_plugin.py").write_text(_PLUGIN)
    parsed, counts = tmp_path / "parsed.json", tmp_path / "counts.json"
    union = sorted({f for files, _ in selections for f in files})
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "gpu_sh_plugin", *union],
        cwd=repo_root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
             "GPU_SH_SCRIPTS": json.dumps(scripts), "GPU_SH_PARSED": str(parsed),
             "GPU_SH_SELECTIONS": json.dumps(selections), "GPU_SH_COUNTS": str(counts)},
    )  # fmt: skip
    assert collect.returncode == 0, collect.stdout[-2000:] + collect.stderr[-2000:]
    assert json.loads(parsed.read_text()) == [], collect.stderr[-3000:]
    empty = [sel for sel, n in zip(selections, json.loads(counts.read_text())) if n == 0]
    assert not empty, f"gpu.sh's pytest calls that select no test: {empty}"


def test_simulation_bn_presets_with_1x1_maps_drop_one_row_batches(sim, tmp_path) -> None:
    """benchmarks/simulation.py's resnet18-imagenet preset (gpu.sh's resnet18tv) trains with
    train.drop_last, as FedProTIP's paper configs do: its layer-4 maps are 1x1 at 32 px, so a
    one-row last minibatch fails in BatchNorm, and the preset's client 71 (641 rows, batch 64)
    is sampled in round 1. The engine modes count the rows that train (TrainSpec.epoch_rows)."""
    import argparse

    from fedforget.models import build_model

    args = argparse.Namespace(preset="resnet18-imagenet", public=0.0, data=str(tmp_path), rounds=1, warmup=1,
                              epochs=1, partition="dirichlet0.5", eval="none", device="cpu", threads=1, memory=0)  # fmt: skip
    assert sim.run_config(args, "sequential").train.drop_last
    model = build_model("resnet18_imagenet", (3, 32, 32), 10).train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(torch.zeros(1, 3, 32, 32))


def test_simulation_train_rows_resizes_a_blobs_preset_only(sim, tmp_path) -> None:
    """benchmarks/simulation.py --train-rows N: a preset on blobs gets N training rows and
    N // 6 test rows (the run loads that dataset); a preset on another dataset is refused."""
    import argparse

    args = argparse.Namespace(preset="mcmahan", public=0.0, data=str(tmp_path), rounds=1, warmup=0, epochs=1,
                              partition="iid", eval="none", device="cpu", threads=1, memory=0, train_rows=600)  # fmt: skip
    sim.prepare(args)
    rc = sim.run_config(args, "sequential")
    assert rc.dataset.options["num_train"] == 600 and rc.dataset.options["num_test"] == 100
    from fedforget.engine import Simulation

    assert sum(Simulation(rc).clients.size(c) for c in range(100)) == 600
    args.preset = "digits"
    with pytest.raises(SystemExit, match="--train-rows 600: preset 'digits' is not on blobs"):
        sim.run_config(args, "sequential")


def test_simulation_uint8_stores_a_blobs_preset_s_images_as_uint8(sim, tmp_path) -> None:
    """benchmarks/simulation.py --uint8 (process_memory.py's too): a preset on blobs has its
    images stored as uint8, as CIFAR's are (a quarter of the float32 bytes), with --train-rows
    or without; a preset on another dataset is refused."""
    import argparse

    from fedforget.data import DATASETS

    args = argparse.Namespace(preset="mcmahan", public=0.0, data=str(tmp_path), rounds=1, warmup=0, epochs=1,
                              partition="iid", eval="none", device="cpu", threads=1, memory=0, train_rows=600,
                              uint8=True)  # fmt: skip
    sim.prepare(args)
    info = DATASETS.get("blobs")
    opts = info.resolve(sim.run_config(args, "sequential").dataset.options)
    assert (opts["num_train"], opts["uint8"], info.input_dtype(opts)) == (600, True, "uint8")
    floats = info.resolve(sim.preset(argparse.Namespace(preset="mcmahan", train_rows=600))["options"])
    assert info.prepared_bytes(opts) < info.prepared_bytes(floats) / 3
    args.train_rows = 0
    assert sim.preset(args)["options"] == {**sim.PRESETS["mcmahan"]["options"], "uint8": True}
    args.preset = "digits"
    with pytest.raises(SystemExit, match="--uint8: preset 'digits' is not on blobs"):
        sim.run_config(args, "sequential")


def test_simulation_engine_modes_count_the_rows_that_train(sim, tmp_path, monkeypatch) -> None:
    """benchmarks/simulation.py's engine modes count a round's samples as the rows that
    train (TrainSpec.epoch_rows): with drop_last, without each client's short last batch."""
    import argparse

    from fedforget.engine import Simulation, sample_clients

    monkeypatch.setitem(sim.PRESETS, "digits", {**sim.PRESETS["digits"], "drop_last": True})
    args = argparse.Namespace(preset="digits", public=0.0, data=str(tmp_path), rounds=1, warmup=0, epochs=2,
                              partition="dirichlet0.5", eval="none", device="cpu", threads=1, memory=0)  # fmt: skip
    sim.prepare(args)
    rc = sim.run_config(args, "sequential")
    sizes = [Simulation(rc).clients.size(c) for c in sample_clients(rc.seed, 0, rc.partition.clients, rc.train.sample_rate)]
    _, one = sim.engine_round(args, "sequential")
    assert one(0)[1] == 2 * sum((n // 32) * 32 if n >= 32 else n for n in sizes) < 2 * sum(sizes)


def test_simulation_prepares_the_public_slice_a_preset_run_loads(sim, tmp_path) -> None:
    """benchmarks/simulation.py --public on a preset whose dataset has options (gpu.sh's
    FedProj on ResNet-18's CIFAR-shaped blobs): the held-out slice is prepared under the id
    the run loads (it was prepared under the bare dataset's, and every such command failed)."""
    import argparse

    args = argparse.Namespace(preset="resnet8", public=0.1, data=str(tmp_path), rounds=1, warmup=1, epochs=1,
                              partition="iid", eval="none", device="cpu", threads=1, memory=0)  # fmt: skip
    assert sim.PRESETS["resnet8"]["options"]  # a dataset with options
    sim.prepare(args)
    rc = sim.run_config(args, "sequential")
    assert (tmp_path / "public" / rc.dataset.public_id / "meta.json").is_file()


def test_simulation_times_the_exchanges_of_a_method_that_has_them(sim, tmp_path) -> None:
    """benchmarks/simulation.py's engine modes report a round's seconds in the exchanges'
    client passes (gpu.sh's FedGP: its round-end buffer gradients), FedAvg none."""
    import argparse

    args = argparse.Namespace(preset="digits", public=0.0, data=str(tmp_path), rounds=2, warmup=1, epochs=1,
                              partition="iid", eval="none", device="cpu", threads=1, memory=0, method="fedgp")  # fmt: skip
    sim.prepare(args)
    for mode in ("sequential", "vectorized"):
        assert sim.measure(args, mode)["exchange_s_per_round"] > 0, mode
    args.method = "fedavg"
    out = sim.measure(args, "vectorized")
    assert "exchange_s_per_round" not in out
    # every round's seconds and training samples, the warm-up's first (gpu_targets.py's VGG-11 rule)
    assert len(out["s_rounds"]) == len(out["n_rounds"]) == 3 and min(out["n_rounds"]) > 0


def test_gpu_targets_reads_each_target_from_the_gpu_runs_files(repo_root, tmp_path) -> None:
    """benchmarks/gpu_targets.py on the H200 runs of 2026-11-27 (their files as gpu.sh wrote
    them): each value the ratio its file holds, a later folder's file replacing an earlier
    one's, an absent or unreadable file not measured (never met); VGG-11's rounds compared
    per training sample, the first 3 rounds left out."""
    res = repo_root / "benchmarks" / "results"
    first, third = res / "h200-2026-11-27", res / "h200-2026-11-27-c"
    profile = tmp_path / "profile-resnet18-fedsol-batched.txt"
    profile.write_text("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    with benchmark_script("gpu_targets") as targets:
        rows = {r["target"]: r for r in targets.evaluate([first, third, tmp_path])}
        only_first = {r["target"]: r for r in targets.evaluate([first])}
        vgg = tmp_path / "vgg11-dir-e1.json"
        for n_rounds, spread in (([64] * 7, 2.0), ([64, 64, 64, 64, 128, 64, 64], 1.0)):
            runs = [{"s_rounds": [4.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0], "n_rounds": n_rounds}]
            vgg.write_text(json.dumps({"runs": {"vectorized": runs}}))
            got = {r["target"]: r for r in targets.evaluate([tmp_path])}
            row = next(r for r in got.values() if r["measure"] == "vectorized_round_spread")
            assert row["value"] == pytest.approx(spread) and row["met"] is (spread <= 1.2)
    summary = json.loads((third / "resnet18-dir-e1.json").read_text())["summary"]
    seq = rows["resnet18 sequential / plain loop"]
    assert seq["file"] == str(third / "resnet18-dir-e1.json")  # the later folder's
    assert seq["value"] == pytest.approx(summary["sequential"]["samples_per_s"] / summary["central"]["samples_per_s"])
    assert seq["met"] is (seq["value"] >= 0.9)
    assert only_first["resnet18 sequential / plain loop"]["file"] == str(first / "resnet18-dir-e1.json")
    fedgp = json.loads((first / "resnet18-e1-fedgp.json").read_text())["summary"]
    assert rows["fedgp resnet18 batched / sequential"]["value"] == pytest.approx(
        fedgp["vectorized"]["samples_per_s"] / fedgp["sequential"]["samples_per_s"])
    busy = rows["fedsol resnet18 batched, GPU busy %"]
    assert busy["value"] is None and busy["met"] is None and "no 'GPU busy N%' line" in busy["why"]
    absent = rows["packing resnet18, 4 jobs / 1"]
    assert absent["value"] is None and absent["met"] is None and absent["why"].startswith("not measured")
    profile.write_text("s/round (median of 2): 0.5\nGPU kernels 0.4 s summed, of 1.0 s wall over 2 profiled rounds "
                       "(GPU busy 64%: the union of their intervals; summed 71%); kernel launches per round 10\n")  # fmt: skip
    with benchmark_script("gpu_targets") as targets:
        busy = next(r for r in targets.evaluate([tmp_path]) if r["measure"] == "gpu_busy_percent")
    assert busy["value"] == 64.0 and busy["met"] is True


def test_simulation_mode_vectorized_at_n_trains_groups_of_at_most_n(sim, tmp_path, monkeypatch) -> None:
    """benchmarks/simulation.py's mode vectorized@N (gpu.sh's width18): the batched engine
    with train.max_parallel_clients N; --modes refuses any other spelling, naming it."""
    import argparse

    from fedforget.trainers import StackedTrainer

    for bad in ("vectorized@0", "vectorized@", "sequential@2", "vectorised"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            sim.mode_arg(bad)
    assert sim.mode_arg("vectorized@3") == "vectorized@3"
    widths = []
    real = StackedTrainer.train_clients_together

    def counted(self, views, rnd, lr):
        widths.append(len(views))
        return real(self, views, rnd, lr)

    monkeypatch.setattr(StackedTrainer, "train_clients_together", counted)
    args = argparse.Namespace(preset="digits", public=0.0, data=str(tmp_path), rounds=1, warmup=0, epochs=1,
                              partition="iid", eval="none", device="cpu", threads=1, memory=0)  # fmt: skip
    sim.prepare(args)
    assert sim.measure(args, "vectorized@3")["samples_per_s"] > 0
    assert widths and max(widths) == 3 and sum(widths) == 10  # the preset's 10 clients a round


def test_simulation_limit_clients_trains_each_sampled_client_in_its_own_minibatches(sim, tmp_path, monkeypatch) -> None:
    """benchmarks/simulation.py's mode limit-clients (the CPU bound of a client-by-client
    schedule): in a round it trains exactly the engine's sampled clients, each in minibatches
    of the batch size with its last one short, so its steps are the clients' steps (mode
    limit's equal shares take fewer) and its samples the engine's."""
    import argparse

    import torch.nn.functional as F

    assert sim.mode_arg("limit-clients") == "limit-clients"
    args = argparse.Namespace(preset="digits", public=0.0, data=str(tmp_path), rounds=1, warmup=0, epochs=2,
                              partition="dirichlet0.5", eval="none", device="cpu", threads=2, memory=0)  # fmt: skip
    sim.prepare(args)
    _, engine = sim.mode_round(args, "sequential")
    _, bound = sim.mode_round(args, "limit-clients")
    engine_samples = engine(1)[1]
    rows: list[int] = []
    real = F.cross_entropy

    def counted(logits, y, *a, **kw):
        rows.append(len(y))
        return real(logits, y, *a, **kw)

    monkeypatch.setattr(F, "cross_entropy", counted)
    assert bound(1)[1] == engine_samples
    from fedforget.engine import Simulation, sample_clients

    rc = sim.run_config(args, "sequential")
    clients, b, want = Simulation(rc).clients, rc.train.batch_size, []
    for k in sample_clients(rc.seed, 1, rc.partition.clients, rc.train.sample_rate):
        size = clients.size(k)
        want += ([b] * (size // b) + ([size % b] if size % b else [])) * args.epochs
    assert any(w < b for w in want)  # clients whose last minibatch is short
    assert sorted(rows) == sorted(want)


def test_profile_round_counts_overlapping_gpu_intervals_once():
    """benchmarks/profile_round.py's GPU busy share: the union of the GPU events' intervals, so
    that kernels overlapping on several streams (lanes, a copy beside a kernel) count once;
    summed, the share passed 100 % (h200-2026-11-27-c's batched profile: 107 %)."""
    with benchmark_script("profile_round") as pr:
        covered = pr.covered
    assert covered([]) == 0
    assert covered([(0, 10), (5, 15), (20, 30)]) == 25  # overlap once, gap left out
    assert covered([(20, 30), (0, 100), (40, 50)]) == 100  # nested, in any order
    assert covered([(0, 1), (1, 2)]) == 2


def test_a_model_that_cannot_fit_is_refused_before_the_data_load(tmp_path, make_run_config, monkeypatch) -> None:
    """A well-typed but huge model option passes validation; the job refuses it before
    loading any data, naming the model, its options and its count, where even three float32
    copies of its weights cannot fit the device's memory (on a GPU, also one copy the
    host's, where every model is built), and trains it where they fit. Before, a 10**7-unit
    layer failed at the allocation after the data load (or was killed at a SLURM job's
    memory limit without a word)."""
    import fedforget.engine as engine
    from fedforget.models import parameter_count

    rc = make_run_config(dataset="digits", model="cnn2d", model_options={"hidden": 10**7})
    monkeypatch.setattr(engine, "load_run_data", lambda *a, **k: pytest.fail("the data were loaded"))
    with pytest.raises(FedForgetError, match=r"dataset.model of 'digits': 'cnn2d' with options \{'hidden': 10000000\} "
                                             r"has 10,350,018,826 parameters, 38.6 GiB in float32; a run holds at least 3 copies"):  # fmt: skip
        engine.Simulation(rc, device=torch.device("cpu"))

    small = make_run_config(dataset="digits", model="cnn2d", model_options={"hidden": 8})
    n = parameter_count("cnn2d", (1, 8, 8), 10, {"hidden": 8})
    limits = {}
    monkeypatch.setattr(engine, "memory_limit", lambda d: limits.get(d.type))
    for dev, cpu, gpu, refused in [
        ("cpu", 12 * n - 1, None, "3 copies of them .* more than cpu-memory"),
        ("cpu", 12 * n, None, None),
        ("cuda", 4 * n, 12 * n - 1, "3 copies of them .* more than gpu-memory"),
        ("cuda", 4 * n - 1, 12 * n, "1 copy of them .* more than cpu-memory"),
        ("cuda", 4 * n, 12 * n, None),
        ("cpu", None, None, None),  # no limit known: nothing refused
    ]:  # fmt: skip
        limits.update(cpu=None if cpu is None else (cpu, "cpu-memory"), cuda=None if gpu is None else (gpu, "gpu-memory"))
        if refused:
            with pytest.raises(FedForgetError, match=refused):
                engine.check_model_fits(small, torch.device(dev))
        else:
            engine.check_model_fits(small, torch.device(dev))


def test_clients_whose_kept_model_copies_cannot_fit_are_refused_before_round_1(make_run_config, monkeypatch) -> None:
    """FedCurv keeps 3 float32 copies of the model per client, SCAFFOLD 1, and FedGP over
    FedCurv its base's: a run whose training clients' copies and the weights' own (3 on a CPU)
    cannot fit in host memory is refused before round 1, naming the method, the copies, the
    clients and both sizes; one byte more and it trains. Only clients that train count: with
    half the clients sampled in one round, half of them."""
    import fedforget.engine as engine
    from fedforget.methods import METHODS, make_params

    assert [METHODS.get(m).client_copies() for m in ("fedavg", "scaffold", "feddyn", "moon", "fedcurv")] == [0, 1, 1, 1, 3]
    over = make_params("fedgp", {"base": "fedcurv"})
    assert METHODS.get("fedgp").client_copies(over) == 3
    limit: list = [None]
    monkeypatch.setattr(engine, "memory_limit", lambda d: limit[0] if d.type == "cpu" else None)
    for method, copies, params, rounds, rate, trained in [("fedcurv", 3, None, 2, 1.0, 4), ("scaffold", 1, None, 2, 1.0, 4),
                                                          ("fedcurv", 3, None, 1, 0.5, 2),
                                                          ("fedgp", 3, {"base": "fedcurv"}, 2, 1.0, 4)]:  # fmt: skip
        rc = make_run_config(method=method, params=params, rounds=rounds, sample_rate=rate)
        sim = engine.Simulation(rc, device=torch.device("cpu"))  # no limit known: nothing refused
        n = sum(p.numel() for p in sim.model.parameters() if p.requires_grad)
        need = 4 * n * (3 + copies * trained)
        limit[0] = (need - 1, "cpu-memory")
        what = f"keeps {copies} cop{'ies' if copies > 1 else 'y'} of the model's {n:,} trained parameters"
        with pytest.raises(FedForgetError, match=rf"method '{method}' {what} .* the {trained} clients that train in this run "
                                                 rf"\(of partition.clients 4, .* more than cpu-memory"):  # fmt: skip
            engine.Simulation(rc, device=torch.device("cpu"))
        limit[0] = (need, "cpu-memory")
        assert engine.Simulation(rc, device=torch.device("cpu")).run(progress=False)[0] == "completed"
        limit[0] = None


def test_a_runs_client_state_mb_is_its_clients_copies_once_all_have_trained(make_run_config) -> None:
    """The train rule's resource client_state_mb (parse.client_state_mb): the MiB, rounded
    up, of the float32 copies of the model's parameters that the method keeps per client,
    for every client of the partition; 0 for a method that keeps none; the same in the rows
    `fedforget validate` prints (parse.client_state_of)."""
    from fedforget.models import parameter_count
    from fedforget.parse import client_state_mb, client_state_of
    from fedforget.partition import PartitionSpec

    wide = {"hidden": [1024, 1024]}
    # FedGP over FedCurv: FedCurv's copies, and its own buffer (iris's 120 rows at most, 32 bytes each)
    for method, params, copies, kept in [("scaffold", None, 1, 0), ("fedcurv", None, 3, 0), ("fedgp", {"base": "fedcurv"}, 3, 120 * 32)]:
        for clients in (4, 100):
            part = PartitionSpec(scheme="iid", clients=clients, seed=0)
            rc = make_run_config(method=method, params=params, model_options=wide, partition=part)
            n = parameter_count("mlp", rc.dataset.input_shape, rc.dataset.num_classes, wide)
            row = client_state_of(rc)
            size = (4 * n * copies + kept) * clients
            assert (row["copies"], row["parameters"], row["clients"], row["bytes"]) == (copies, n, clients, size)
            assert client_state_mb(rc) == -(-size // 2**20), (method, clients)
    # by hand: iris's 4 inputs, 3 classes: 4*1024+1024 + 1024*1024+1024 + 1024*3+3 = 1,057,795
    # parameters, x 4 bytes x 100 clients = 423,118,000 bytes = 403.5 MiB
    assert client_state_mb(make_run_config(method="scaffold", model_options=wide,
                                           partition=PartitionSpec(scheme="iid", clients=100, seed=0))) == 404
    assert client_state_of(make_run_config(method="fedavg")) is None and client_state_mb(make_run_config(method="fedavg")) == 0


def test_client_state_mb_counts_buffers_and_bases_at_their_fullest(make_run_config, monkeypatch) -> None:
    """Besides model copies, the resource counts what a method keeps per client at most
    (``FedAvg.client_kept_bytes``), by hand on iris (4 inputs, 3 classes, 120 training rows)
    and the wide MLP: A-GEM's 200 rows, a client never holding more than the dataset's 120
    rows (4 float32 inputs, y and task int64: 32 bytes); DER adds 3 float32 logits per row;
    FedGP over SCAFFOLD keeps SCAFFOLD's copy and its own buffer; GPM's local bases at most
    d_l x d_l float32 per layer (d = 4, 1,024, 1,024), none with a global memory; twice the
    rows under asynchronous windows (a clipped window offers again)."""
    from fedforget.models import parameter_count
    from fedforget.parse import client_state_mb, client_state_of
    from fedforget.partition import PartitionSpec

    wide = {"hidden": [1024, 1024]}
    part = PartitionSpec(scheme="iid", clients=100, seed=0)
    n = parameter_count("mlp", (4,), 3, wide)
    gpm = 4 * (4 * 4 + 2 * 1024 * 1024)
    for method, params, per_client in [
        ("agem", None, 120 * 32),
        ("agem", {"buffer_size": 50}, 50 * 32),
        ("der", {"buffer_size": 50}, 50 * (32 + 12)),
        ("fedgp", {"base": "scaffold", "buffer_size": 50}, 4 * n + 50 * 32),
        ("gpm", None, gpm),
    ]:
        rc = make_run_config(method=method, params=params, model_options=wide, partition=part)
        row = client_state_of(rc)
        assert (row["kept_bytes"], row["bytes"]) == (per_client - 4 * n * row["copies"], per_client * 100), method
        assert client_state_mb(rc) == -(-per_client * 100 // 2**20), method
    assert client_state_mb(make_run_config(method="gpm", model_options=wide, partition=part)) == 801  # 838,867,200 B
    assert client_state_of(make_run_config(method="gpm", params={"memory": "global"})) is None
    # a row's bytes as the model sees it: uint8 images become float32, int64 token ids stay int64
    from fedforget.parse import client_shape

    assert [client_shape(make_run_config(dataset=d, model=m), lambda: None).row_bytes
            for d, m in [("iris", "mlp"), ("cifar10", "cnn_mcmahan"), ("sst2", "hf")]] == [16, 3 * 32 * 32 * 4, 2 * 128 * 8]  # fmt: skip
    # the job's resource builds no model a method does not size by (a ViT's would import torchvision)
    import fedforget.parse as parse

    built, real = [], parse.meta_model
    monkeypatch.setattr(parse, "meta_model", lambda *a: built.append(a[0]) or real(*a))
    for method in ("fedavg", "agem", "der", "scaffold", "gpm"):
        client_state_mb(make_run_config(method=method, partition=part))
    assert built == ["mlp", "mlp"]  # SCAFFOLD's copies, GPM's bases
    windows = {"kind": "split", "tasks": 3, "classes_per_task": 1, "boundaries": {"samples_per_window": 10, "window_rounds": 1}}
    assert client_state_of(make_run_config(method="agem", params={"buffer_size": 10**6}, scenario=windows))["kept_bytes"] == 240 * 32


def test_the_host_memory_limit_reads_the_machine_and_its_control_group(tmp_path, monkeypatch) -> None:
    """The machine's memory and swap, or its control group's limit where smaller: cgroup v2
    (a parent's memory.max counts, "max" is none) and v1 (its ~2**63 is none); None where
    nothing can be read."""
    import fedforget.utils as utils

    root = tmp_path / "cg"
    (tmp_path / "meminfo").write_text("MemTotal:  1000 kB\nMemFree: 10 kB\nSwapTotal:  24 kB\n")
    monkeypatch.setattr(utils, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(utils, "CGROUPS", tmp_path / "cgroup")
    monkeypatch.setattr(utils, "CGROUP_ROOT", root)
    assert utils.host_memory_limit() == (1024 * 1024, "this machine's memory and swap")  # no cgroup file
    (tmp_path / "cgroup").write_text("0::/slurm/job_7/step_0\n")
    (root / "slurm" / "job_7" / "step_0").mkdir(parents=True)
    (root / "slurm" / "job_7" / "step_0" / "memory.max").write_text("max\n")
    assert utils.host_memory_limit()[0] == 1024 * 1024
    (root / "slurm" / "job_7" / "memory.max").write_text("524288\n")  # the job's --mem, on the parent
    assert utils.host_memory_limit() == (524288, f"its control group's memory limit ({root}/slurm/job_7/memory.max)")
    (tmp_path / "cgroup").write_text("4:memory:/job\n")
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert utils.host_memory_limit()[0] == 1024 * 1024
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text("4096\n")
    assert utils.host_memory_limit()[0] == 4096
    monkeypatch.setattr(utils, "MEMINFO", tmp_path / "none")
    monkeypatch.setattr(utils, "CGROUPS", tmp_path / "none")
    assert utils.host_memory_limit() is None


CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 16000000000000 bytes. Error code 12 (Cannot allocate memory)")  # fmt: skip


def test_a_job_out_of_memory_names_the_largest_sizes_its_config_sets(tmp_path, make_run_config, monkeypatch) -> None:
    """Out of memory anywhere in a job (here DER's buffer of 10**12 rows, in round 1; a GPU's
    OutOfMemoryError while the run is set up): one FedForgetError saying where, with torch's
    first line and the config's sizes largest first, the run recorded failed with it; any
    other error stays what it was. (The allocation is faked: on a machine that overcommits
    memory a real 16 TB buffer would be killed, not refused.)"""
    import fedforget.engine as engine
    from fedforget.methods.replay import Reservoir

    def refuse(self, state, fields, rows=None):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(Reservoir, "rows_for", refuse)
    rc = make_run_config(method="der", params={"buffer_size": 10**12}, device="cpu")
    with pytest.raises(FedForgetError) as ei:
        run_training(rc, tmp_path / "run", progress=False)
    msg = str(ei.value)
    assert msg.startswith(f"out of memory on cpu in round 1 ({CPU_OOM}); the largest sizes this run's config sets: "
                          "method.params.buffer_size=1000000000000, train.eval_batch_size=1024, ")  # fmt: skip
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "failed" and record["error"] == f"FedForgetError: {msg}"
    # a real number may scale a size too (FOT's sketch width is sketch_factor x a layer's width)
    from fedforget.runner import config_sizes

    sized = config_sizes(make_run_config(method="fot", params={"sketch_factor": 3e38, "residual_ratio": "norm"}))
    assert sized[0] == ("method.params.sketch_factor", 3e38) and "method.params.residual_ratio" not in dict(sized)

    def gpu_oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore")

    monkeypatch.setattr(engine.Simulation, "__init__", gpu_oom)
    with pytest.raises(FedForgetError, match=r"^out of memory on train.device 'cpu' while setting up the run \(CUDA out of "
                                             r"memory. Tried to allocate 20.00 GiB\); the largest"):  # fmt: skip
        run_training(make_run_config(device="cpu"), tmp_path / "run2", progress=False)

    def other(self, *a, **k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(engine.Simulation, "__init__", other)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run_training(make_run_config(device="cpu"), tmp_path / "run3", progress=False)
