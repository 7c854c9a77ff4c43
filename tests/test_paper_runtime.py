"""benchmarks/paper_runtime.py --model-rates (issue 32, item 6): a paper run timed at its
model's measured rates (benchmarks/model_rates.py's rows) instead of the FLOP model's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from .conftest import benchmark_script

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "config/experiments/paper"


@pytest.fixture(scope="module")
def pr():
    with benchmark_script("paper_runtime") as mod:
        yield mod


def table1_run(pr):
    """The first run of FedSOL Table 1 (CIFAR-10: 50,000 training and 10,000 test rows; 100
    clients at 0.1, 5 local epochs, batch 50; the McMahan CNN)."""
    return pr.config_runs(PAPER / "fedsol_table1.yaml")[0]


def rates_file(path: Path, device: str, rows: list[dict]) -> str:
    path.write_text(json.dumps({"setting": {"device": device}, "rows": rows}))
    return str(path)


def test_a_measured_setting_times_its_runs_at_its_rates(pr, tmp_path):
    rc = table1_run(pr)
    t = rc.train
    assert (t.sample_rate, t.local_epochs, t.batch_size, rc.dataset.model) == (0.1, 5, 50, "cnn_mcmahan")
    flop = pr.estimate_run(rc, {}, {"vectorized": 1e13, "sequential": 1e12})
    assert flop["measured_eval"] is None and flop["measured_seconds"] == flop["seconds"]  # nothing measured

    setting = {"model": "cnn_mcmahan", "options": {}, "shape": [3, 32, 32], "batch": 50, "engine": flop["engine"]}
    path = rates_file(tmp_path / "r.json", "NVIDIA H200", [
        {**setting, "samples_per_s": 1000.0, "eval_samples_per_s": 4000.0},
        {**setting, "batch": 64, "samples_per_s": 1.0, "eval_samples_per_s": 1.0},  # another setting
        {**setting, "engine": "other", "samples_per_s": 1.0, "eval_samples_per_s": 1.0},  # another engine
        {**setting, "shape": [1, 28, 28], "error": "not measured: --budget spent"},
    ])  # fmt: skip
    measured, device = pr.measured_rates([path])
    assert device == "NVIDIA H200" and len(measured) == 3
    m = 2.0  # the method's time per round over FedAvg's (method_cost.py)
    est = pr.estimate_run(rc, {rc.method.name: m}, {"vectorized": 1e13, "sequential": 1e12}, measured)
    train = 0.1 * 50_000 * 5  # inputs trained per round
    evals = 10_000 / t.eval_every  # the global model on the test set (no local models' evaluation here)
    assert not t.eval_local_models
    assert est["measured_seconds"] == pytest.approx(t.rounds * (train * m / 1000.0 + evals / 4000.0))
    assert est["measured_eval"] is True  # and the FLOP model's time beside it, as without the rates:
    assert est["seconds"] == pr.estimate_run(rc, {rc.method.name: m}, {"vectorized": 1e13, "sequential": 1e12})["seconds"]

    # a row of an older file, without the evaluation rate: evaluation at 3x the training rate, said so
    del measured[next(iter(measured))]["eval_samples_per_s"]
    est = pr.estimate_run(rc, {}, {"vectorized": 1e13, "sequential": 1e12}, measured)
    assert est["measured_seconds"] == pytest.approx(t.rounds * (train / 1000.0 + evals / 3000.0))
    assert est["measured_eval"] is False


def test_a_frozen_encoders_kept_features_are_computed_once(pr):
    row = {"samples_per_s": 100.0, "eval_samples_per_s": 50.0}
    seconds, measured = pr.measured_run(row, rounds=10, train=200.0, m=1.5, evals=999.0, distinct=5000.0)
    assert measured and seconds == pytest.approx(5000 / 50 + 10 * 200 * 1.5 / 100)


def test_rates_of_several_devices_are_refused_and_pretrained_is_not_part_of_a_setting(pr, tmp_path):
    a = rates_file(tmp_path / "a.json", "NVIDIA H200", [])
    b = rates_file(tmp_path / "b.json", "cpu", [])
    with pytest.raises(SystemExit, match="several devices \\(NVIDIA H200, cpu\\)"):
        pr.measured_rates([a, b])
    assert pr.setting_key("vit", {"pretrained": True, "x": 1}, [3, 224, 224], 32) == pr.setting_key(
        "vit", {"x": 1}, (3, 224, 224), 32
    )


def test_model_rates_measures_again_a_setting_measured_with_another_trainer(tmp_path):
    """model_rates.py --skip: a setting measured before with the trainer it runs with now is
    not measured again; one measured with the other trainer is (paper_runtime looks the rate
    up by setting and trainer: the H200's first rates were of the sequential trainer)."""
    import argparse

    a = argparse.Namespace(device="cpu", clients=2, steps=1, eval_rows=8, data=str(tmp_path), warmup=0, rounds=1,
                           threads=1, concurrent=1)  # fmt: skip
    s = {"model": "cnn_fedgp", "options": {}, "shape": [1, 28, 28], "batch": 32, "paper_runs": 1}
    with benchmark_script("model_rates") as mr:
        now = mr.expected_engine(s, a)
        other = {"sequential": "vectorized", "vectorized": "sequential"}[now]
        assert mr.measured_before(s, {(mr._key(s), now)}, a)
        assert not mr.measured_before(s, {(mr._key(s), other)}, a)
        assert mr.expected_engine({**s, "client_engine": other}, a) == other


def test_continual_cost_files_give_each_method_its_ratio_against_its_own_fedavg(pr, monkeypatch):
    """Several continual_cost.json files (the 2026-12-05 one adds Tar+LODE and Fed+SCR): each
    method's median round over its own file's FedAvg; a method in two files keeps the first's;
    every registered continual method of the paper configs has one by the default files."""

    def cost(**medians):
        return {"methods": {n: {"s_per_round": {"median": v}} for n, v in medians.items()}}

    got = pr.method_ratios([{"ratio_vs_fedavg": {"fedprox": 1.5}}, {"ratio_vs_fedavg": {"fedprox": 9.0, "moon": 2.0}}],
                           cost(fedavg=2.0, target=8.0),
                           cost(fedavg=1.0, target=1.0, scr=3.0))  # fmt: skip
    assert got == {"fedprox": 1.5, "moon": 2.0, "fedavg": 1.0, "target": 4.0, "scr": 3.0}
    monkeypatch.setattr("sys.argv", ["paper_runtime.py"])
    files = pr.parse_args().continual_cost
    assert [Path(f).parent.name for f in files] == ["cpu-2026-12-06-e", "cpu-2026-12-05-d", "cpu-2026-12-05-d"]
    one_task = [json.loads(Path(f).read_text()) for f in pr.parse_args().method_cost]
    ratios = pr.method_ratios(one_task, *(json.loads(Path(f).read_text()) for f in files))
    assert {"target", "target_lode", "lander", "scr", "icarl", "glfc", "l2p", "fedgp+l2p"} <= set(ratios)
    for path in PAPER.glob("*.yaml"):  # every pairing of the paper tables
        for rc in pr.config_runs(path):
            if rc.method.params.get("base", "fedavg") != "fedavg":  # over FedAvg: the method's own ratio
                assert f"{rc.method.name}+{rc.method.params['base']}" in ratios, (path.name, rc.method.label)


def test_a_method_over_a_base_takes_the_ratio_measured_over_that_base(pr):
    """FedGP over L2P (FedGP Tables 1/11, on a ViT) at ``fedgp+l2p``'s ratio, measured against
    FedAvg on a ViT; FedGP over FedAvg (no base given) and over a base never measured at FedGP's."""
    runs = pr.config_runs(PAPER / "fedgp_table1_table11.yaml")
    over = {rc.method.params.get("base") for rc in runs if rc.method.name == "fedgp"}
    assert {"l2p", "der"} <= over
    rate = {"vectorized": 1e13, "sequential": 1e12}
    ratios = {"fedgp": 2.0, "fedgp+l2p": 3.0}
    for rc in runs:
        if rc.method.name == "fedgp" and rc.method.params.get("base") in ("l2p", "der"):
            alone = pr.estimate_run(rc, {}, rate)["flops"]
            m = 3.0 if rc.method.params["base"] == "l2p" else 2.0
            est = pr.estimate_run(rc, ratios, rate)
            assert est["measured_m"] and est["flops"] > alone
            assert est["flops"] == pytest.approx(pr.estimate_run(rc, {"fedgp": m}, rate)["flops"])


def test_the_docs_time_every_run_the_paper_configs_hold_now(pr):
    """docs/paper_tables.md's table of hours reads one paper_runtime.json: a config that gained or
    lost runs since (a method added to a table) leaves that table's hours stale until the script
    is run again (its README names the command) and the docs' markers point at the new file."""
    import re

    doc = (REPO / "docs/paper_tables.md").read_text()
    files = set(re.findall(r"<!--@ ([\w./-]+/paper_runtime\.json):tables\.\d+\.runs ", doc))
    assert len(files) == 1, files
    used = files.pop()
    again = (f"docs/paper_tables.md's hours ({used}) are stale: run benchmarks/paper_runtime.py as that folder's "
             "README says (--json, --model-rates, --recon-cost) into a new results folder and point the markers at it")
    rows = json.loads((REPO / "benchmarks/results" / used).read_text())["tables"]
    paper = sorted(PAPER.glob("*.yaml"))
    assert sorted(r["config"] for r in rows) == [p.name for p in paper], again
    for path, row in zip(paper, sorted(rows, key=lambda r: r["config"])):
        runs = pr.config_runs(path)
        assert len(runs) == row["runs"], (path.name, len(runs), row["runs"], again)
        assert not row["unmeasured_methods"], (path.name, row["unmeasured_methods"], again)


@pytest.mark.parametrize("variant", ["target", "lander"])
def test_the_synthesis_rows_are_those_a_synthesis_runs(pr, variant):
    """paper_runtime.synthesis_rows (the task-end cost of TARGET / Tar+LODE / LANDER) reads the
    synthesizer's schedule: its counts equal the rows a real synthesis passes through the
    teacher and the student (counted at their heads), with warm-up rounds, the boundary term's
    rounds, student KD steps on a pool smaller than student_batch at first, and LANDER's
    syn_rounds + warmup rounds whose first ones store nothing."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from fedforget.methods import make_params
    from fedforget.methods.base import frozen_copy
    from fedforget.methods.lander import LanderSynthesizer
    from fedforget.methods.synthesis import Synthesizer
    from fedforget.models import Classifier

    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 6))
    model = Classifier(body, 6, 4)
    params = {"syn_size": 40, "syn_batch": 12, "syn_rounds": 4, "g_steps": 2, "warmup": 2, "nz": 8, "ngf": 4,
              "student_steps": 3, "student_batch": 30}  # fmt: skip
    if variant == "lander":
        model.lte_map = nn.Linear(6, 5)
        lte = F.normalize(torch.randn(4, 5), dim=1)
        p = make_params("lander", params)
        synth = LanderSynthesizer(p, frozen_copy(model), torch.arange(4), (1, 4, 4), torch.device("cpu"), (0, 0), lte)
    else:
        p = make_params("target", params)
        synth = Synthesizer(p, frozen_copy(model), torch.arange(4), (1, 4, 4), torch.device("cpu"), (0, 0))
    seen = {"teacher": 0, "student": 0}
    for name, net in (("teacher", synth.teacher), ("student", synth.student)):
        net.head.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, seen[name] + len(i[0])))
    synth.run()
    w = pr.synthesis_rows(type(synth), p)
    assert w["generator"] == w["teacher_grad"] == synth.rounds() * 2 * 12
    assert seen == {"teacher": w["teacher_grad"] + w["student_kd"], "student": w["student_grad"] + w["student_kd"]}
    assert 0 < w["student_grad"] < w["teacher_grad"] and w["student_kd"] > 0


def test_glfc_reconstructions_are_counted_per_task_and_timed_on_their_device(pr, tmp_path):
    """GLFC (and FedGP over it) inverts one prototype gradient per class of each sampled
    client's task at every task start: tasks x sampled clients x classes per task; timed at
    recon_cost.py's seconds per sample, joining measured_hours only with rates of its device."""
    runs = pr.config_runs(PAPER / "fedgp_table1_table11.yaml")
    glfc = [rc for rc in runs if "glfc" in (rc.method.name, rc.method.params.get("base"))]
    assert {rc.method.name for rc in glfc} == {"glfc", "fedgp"}
    rc = next(r for r in glfc if r.dataset.scenario["tasks"] == 10)  # split CIFAR-100, 10 x 10, 10 clients
    n, p = pr.recon_samples(rc, 100)
    assert n == 10 * 10 * 10 and (p.recon_iters, p.recon_inner) == (250, 20)
    assert pr.recon_samples(next(r for r in runs if r.method.name == "fedavg"), 100) == (0, None)

    path = tmp_path / "recon.json"
    path.write_text(json.dumps({"setting": {"device": "cpu"}, "rows": [
        {"shape": [3, 32, 32], "classes": 100, "recon_iters": 250, "recon_inner": 20, "s_per_sample": 2.0}]}))  # fmt: skip
    recon, device = pr.recon_rates(str(path))
    rate = {"vectorized": 1e13, "sequential": 1e12}
    plain = pr.estimate_run(rc, {}, rate)
    timed = pr.estimate_run(rc, {}, rate, None, "cuda", recon, False)
    assert device == "cpu" and timed["recon_seconds"] == 2.0 * n and plain["recon_seconds"] is None
    assert timed["measured_seconds"] == plain["measured_seconds"] == plain["seconds"]
    joined = pr.estimate_run(rc, {}, rate, None, "cuda", recon, True)
    assert joined["measured_seconds"] == pytest.approx(plain["seconds"] + 2.0 * n)


def test_a_domain_streams_task_holds_one_domains_rows(pr):
    """FedProTIP's DomainNet stream (6 domains of 10,000 training rows): a task trains on one
    domain's rows, not on all 60,000; rotated MNIST's task on every row (each task rotates
    them all)."""
    dn = next(rc for rc in pr.config_runs(PAPER / "fedprotip_table1_table5.yaml") if rc.dataset.scenario["kind"] == "domains")
    assert pr.rows_per_task(dn)[0] == 10_000
    rot = next(rc for rc in pr.config_runs(PAPER / "fedgp_table1_table11.yaml") if rc.dataset.scenario["kind"] == "rotated")
    assert pr.rows_per_task(rot)[0] == 60_000


def test_an_evaluation_of_a_rotated_stream_scores_every_tasks_rotated_test_set(pr):
    """The evaluator scores every task at each evaluation (``Evaluator.global_model``): a
    permuted MNIST stream of 10 tasks evaluates its 10,000 test rows 10 times, a split stream
    its test rows once (each task its classes' share)."""
    from fedforget.data import DATASETS
    runs = pr.config_runs(PAPER / "fedgp_table1_table11.yaml")
    rate = {"vectorized": 1e13, "sequential": 1e12}
    for kind, tasks in (("permuted", 10), ("split", 1)):
        rc = next(r for r in runs if r.dataset.scenario["kind"] == kind and r.method.name == "fedavg")
        t, info = rc.train, DATASETS.get(rc.dataset.name)
        shape = tuple(info.input_shape(info.resolve(rc.dataset.options)))
        f = pr.model_flops(rc.dataset.model, dict(rc.dataset.model_options or {}), shape, info.num_classes)[0]
        rows, n_test = pr.rows_per_task(rc)
        est = pr.estimate_run(rc, {"fedavg": 1.0}, rate)
        train = t.sample_rate * rows * t.local_epochs
        assert est["flops"] == pytest.approx(t.rounds * (3 * f * train + f * n_test * tasks / t.eval_every))


def test_task_ends_are_counted_once_per_task_as_the_files_training_inputs(pr, tmp_path):
    """A run whose method (or base) has task ends (FedProTIP's bases, FOT's, iCaRL's exemplars)
    gets one per task, each as task_end_cost.py's training inputs of its setting (3 F each, at
    the run's engine's rate; at its measured samples/s with --model-rates); a run without a row
    for its setting is counted as none and said so; TARGET's synthesis is not counted twice."""
    runs = pr.config_runs(PAPER / "fedprotip_table1_table5.yaml")
    by = {rc.method.name: rc for rc in reversed(runs) if rc.dataset.scenario["kind"] == "split"}
    rc, fot = by["fedprotip"], by["fot"]
    assert rc.dataset.scenario["tasks"] == 10
    path = tmp_path / "te.json"
    row = {**pr.task_end_setting(rc), "task_end_rows": 1000.0}
    path.write_text(json.dumps({"setting": {"device": "cpu"}, "rows": [row, {**row, "clients": 7, "error": "x"}]}))
    ends = pr.task_end_rates([str(path)])
    assert len(ends) == 1  # the row with an error is left out
    rate = {"vectorized": 1e13, "sequential": 1e12}
    plain, timed = pr.estimate_run(rc, {}, rate), pr.estimate_run(rc, {}, rate, task_ends=ends)
    f = (timed["flops"] - plain["flops"]) / (10 * 1000.0 * 3)  # the model's forward FLOPs per input
    assert timed["task_end_flops"] == pytest.approx(10 * 1000.0 * 3 * f) and f > 1e6
    assert timed["seconds"] - plain["seconds"] == pytest.approx(timed["task_end_flops"] / rate[timed["engine"]])
    assert (plain["task_end"], timed["task_end"]) == ("unmeasured", "measured") and plain["task_end_flops"] == 0
    # at measured rates: the same inputs at the setting's samples/s
    info = pr.DATASETS.get(rc.dataset.name)
    shape = info.input_shape(info.resolve(rc.dataset.options))
    key = pr.setting_key(rc.dataset.model, rc.dataset.model_options, shape, rc.train.batch_size)
    measured = {(key, timed["engine"]): {"samples_per_s": 500.0, "eval_samples_per_s": 2000.0}}
    a = pr.estimate_run(rc, {}, rate, measured)
    b = pr.estimate_run(rc, {}, rate, measured, task_ends=ends)
    assert b["measured_seconds"] - a["measured_seconds"] == pytest.approx(10 * 1000.0 / 500.0)
    # another setting (FOT's) has no row: none counted; FedAvg and TARGET have no such task ends
    assert pr.estimate_run(fot, {}, rate, task_ends=ends)["task_end"] == "unmeasured"
    for name in ("fedavg", "target"):
        assert pr.estimate_run(by[name], {}, rate, task_ends=ends)["task_end"] is None
    assert not pr.has_task_end("target", {}) and pr.has_task_end("fedgp", {"base": "icarl"})
    assert not pr.has_task_end("fedgp", {"base": "der"})
    # the thresholds set the ranks, not the work: one setting for Table 11's thresholds
    t11 = [r for r in pr.config_runs(PAPER / "fedprotip_table11.yaml") if r.method.name == "fedprotip"]
    assert len({r.method.params["threshold"] for r in t11}) > 1
    assert len({pr.task_end_key(pr.task_end_setting(r)) for r in t11}) < len(t11)


def test_task_end_cost_times_what_a_client_reads_and_scales_a_whole_read(tmp_path):
    """task_end_cost.py on two of the paper's MNIST settings, cut to 2 clients of 60 rows: GPM
    samples 125 rows (all 60 here), FOT reads every row; the clients' part scales to the run's
    10 clients and to the rows the same reads draw from its 6,000 rows a client (125 and
    6,000), and a task end becomes training inputs at the plain loop's rate."""
    import argparse

    with benchmark_script("task_end_cost") as te:
        settings = {s["method"]: s for s in te.paper_settings() if s["model"] == "cnn_fedgp"}
        a = argparse.Namespace(cap=60, max_clients=2, threads=1, repeats=1, train_steps=1, data=str(tmp_path))
        gpm, fot = te.measure(settings["gpm"], a), te.measure(settings["fot"], a)
    for r in (gpm, fot):
        assert (r["clients"], r["rows_per_client"], r["clients_bench"], r["rows_bench"]) == (10, 6000, 2, 60)
        assert r["rows_read"] == 60
        assert 0 < r["clients_s"] <= r["task_end_s"] and r["train_samples_per_s"] > 0
        assert r["task_end_s_scaled"] == pytest.approx(r["clients_s"] * r["scale"] + r["server_s"])
        assert r["task_end_rows"] == pytest.approx(r["task_end_s_scaled"] * r["train_samples_per_s"])
    assert (gpm["reads_all"], gpm["rows_read_at_run"], fot["reads_all"], fot["rows_read_at_run"]) == (False, 125, True, 6000)
    assert gpm["scale"] == pytest.approx(125 / 60 * 10 / 2) and fot["scale"] == pytest.approx(6000 / 60 * 10 / 2)


def test_a_task_end_made_in_the_last_round_is_the_sampled_clients_work(pr):
    """FOT's local sketch is made by the clients trained in a task's last round: Table 3's runs
    of 10 and 20 clients sampling 5 have 5 clients at a task end, its 5-client runs 5, and its
    FedProTIP runs (a TASK_END reply from every client) all of them; FOT's global variant too.
    A row written before ``end_clients`` keys as if it timed every client."""
    runs = pr.config_runs(PAPER / "fedprotip_table3.yaml")
    seen = {(rc.method.name, rc.partition.clients): pr.end_clients(rc) for rc in runs if pr.has_task_end(
        rc.method.name, dict(rc.method.params))}  # fmt: skip
    assert {c: n for (m, c), n in seen.items() if m == "fot"} == {5: 5, 10: 5, 20: 5}
    assert {c: n for (m, c), n in seen.items() if m == "fedprotip"} == {5: 5, 10: 10, 20: 20}
    fot = next(rc for rc in runs if rc.method.name == "fot" and rc.partition.clients == 20)
    glob = replace(fot, method=replace(fot.method, params={**fot.method.params, "sketch_model": "global"}))
    assert pr.end_clients(glob) == 20
    s = pr.task_end_setting(fot)
    old = {k: v for k, v in s.items() if k != "end_clients"}
    assert pr.task_end_key(old) != pr.task_end_key(s)  # an old row timed all 20: not this setting
    assert pr.task_end_key(old) == pr.task_end_key({**s, "end_clients": 20})


def test_a_repeated_training_is_found_whatever_its_experiment_labels_evaluation_or_task_il(pr):
    """``training_key``: FedGP Table 1/11's CIFAR-10 FL run and its task-IL twin, relabelled,
    in another experiment, evaluated otherwise and with other diagnostics, train the same (the
    task-IL one bit for bit: tests/methods/test_task_il.py); another seed, lr or partition does
    not, nor another evaluation chunk (CFeD's and FedDF's trained-on scores are computed in
    chunks of it) or an experiment that pairs engines (found in review)."""
    runs = pr.config_runs(PAPER / "fedgp_table1_table11.yaml")
    rc = next(r for r in runs if r.experiment == "fedgp_t1_cifar10" and r.method.label == "FL" and r.seed == 0)
    scenario = {**rc.dataset.scenario, "incremental": "task"}
    twin = replace(
        rc, experiment="other", method=replace(rc.method, label="FedAvg"),
        dataset=replace(rc.dataset, label="split-cifar10-task-il", scenario=scenario),
        train=replace(rc.train, eval_every=1, eval_local_models=True, diagnostics=("weight_divergence",)),
    )  # fmt: skip
    assert twin.hash != rc.hash and pr.training_key(twin) == pr.training_key(rc)
    lr = replace(rc.train.optimizer, lr=rc.train.optimizer.lr / 2)
    for other in (replace(rc, seed=1), replace(rc, train=replace(rc.train, optimizer=lr)),
                  replace(rc, partition=replace(rc.partition, alpha=0.5)),
                  replace(rc, train=replace(rc.train, eval_batch_size=64)),
                  replace(rc, train=replace(rc.train, engine_pairing="fedsol"))):  # fmt: skip
        assert pr.training_key(other) != pr.training_key(rc)


def test_frozen_stages_cut_the_backward_passes_after_the_first_task(pr):
    """freeze_stages: ``held_share`` is the frozen layers' share of the forward FLOPs (here
    counted by hand: the CIFAR stem's and layer1's and layer2's convolutions of the FedProTIP
    code's ResNet-18 on 32 px), and a run's passes per training input fall from 3 to 3 - 2h
    after the first task (FedProTIP Table 1's CIFAR-100 run: 10 tasks); a measured rate is
    scaled alike."""
    from fedforget.models import build_model

    model = build_model("resnet18_imagenet", (3, 32, 32), 100, {"stem": "cifar", "pool": 2, "freeze_stages": 2})
    f, _, _ = pr.model_flops("resnet18_imagenet", {"stem": "cifar", "pool": 2}, (3, 32, 32), 100)
    macs = 32 * 32 * 3 * 64 * 9 + 4 * 32 * 32 * 64 * 64 * 9  # stem, layer1
    macs += 16 * 16 * (64 * 128 * 9 + 3 * 128 * 128 * 9 + 64 * 128)  # layer2 (its downsample too)
    h = pr.held_share(model, (3, 32, 32))
    assert h == pytest.approx(2 * macs / f, rel=1e-9) and 0.5 < h < 0.55
    assert pr.held_share(build_model("resnet18_imagenet", (3, 32, 32), 100, {"stem": "cifar"}), (3, 32, 32)) == 0.0
    assert pr.training_passes(h, 1) == 3.0 and pr.training_passes(0.5, 10) == pytest.approx(2.1)
    rc = next(r for r in pr.config_runs(PAPER / "fedprotip_table1_table5.yaml")
              if r.method.name == "fedavg" and r.dataset.name == "cifar100")  # fmt: skip
    assert rc.dataset.model_options["freeze_stages"] == 2 and rc.dataset.scenario["tasks"] == 10
    free = replace(rc, dataset=replace(rc.dataset, model_options={**rc.dataset.model_options, "freeze_stages": 0}))
    rate = {"vectorized": 1e13, "sequential": 1e13}
    a, b = pr.estimate_run(rc, {}, rate), pr.estimate_run(free, {}, rate)
    t = rc.train
    train = t.sample_rate * pr.rows_per_task(rc)[0] * t.local_epochs * t.rounds
    assert b["flops"] - a["flops"] == pytest.approx((3 - pr.training_passes(h, 10)) * f * train, rel=1e-9)
