"""The console script, in-process via ``fedforget.cli.main``."""

from __future__ import annotations

import json

import pytest
import yaml

import fedforget
from fedforget.cli import main
from fedforget.data import DATASETS
from fedforget.methods import METHODS
from fedforget.models import MODELS
from fedforget.utils import byte_size


def test_version(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedforget {fedforget.__version__}"


@pytest.mark.parametrize(
    "cmd,registry,must",
    [
        ("datasets", DATASETS, {"digits", "mnist1d", "iris"}),
        ("methods", METHODS, {"fedavg"}),
        ("models", MODELS, {"mlp", "cnn2d", "cnn1d"}),
    ],
)
def test_list_commands_one_name_per_line(capsys, cmd, registry, must):
    assert main([cmd]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == registry.names() == sorted(lines)
    assert must <= set(lines)
    assert all(line and " " not in line for line in lines)


def test_partitioners(capsys):
    assert main(["partitioners"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {"dirichlet", "iid", "shards"} <= set(lines) and lines == sorted(lines)


def test_validate_shipped_config(capsys, repo_root):
    assert main(["validate", "--config", str(repo_root / "config/config.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    assert "= 18 training jobs" in out
    # each distinct dataset and model once, sized without building it (a size typed wrong shows here)
    datasets, models = out.split("datasets (sizes known before they are built):\n")[1].split(
        "models (parameters counted without building them):\n")
    assert datasets.splitlines() == ["  digits: 1,347 train / 450 test rows of [1, 8, 8] float32, 463.3 KiB prepared",
                                     "  mnist1d: 4,000 train / 1,000 test rows of [1, 40] float32, 820.3 KiB prepared"]  # fmt: skip
    models, kept = models.split("what clients keep across rounds")
    assert models.splitlines() == ["  cnn2d on digits [1, 8, 8], 10 classes: 151,306 parameters (591.0 KiB in float32)",
                                   "  cnn1d on mnist1d [1, 40], 10 classes: 106,186 parameters (414.8 KiB in float32)"]  # fmt: skip
    # DER's buffer, 200 rows of 64 float32 inputs, a label, a task and 10 logits: 200 x 312 = 62,400 bytes per client
    assert kept.splitlines()[1:] == [
        f"  FL+DER on cnn2d (digits-{s} [1, 8, 8]), 5 clients: at most 60.9 KiB of replay rows, exemplars, bases or class reports "
        "per client, 304.7 KiB (client_state_mb 1) once all have trained" for s in ("class-il", "task-il")
    ]


def test_validate_lists_what_clients_keep(capsys, tmp_path, repo_root):
    """SCAFFOLD keeps a copy of the model per client, FedCurv three, FedGP over FedCurv its
    base's and its own buffer, A-GEM a buffer: validate prints what they take in host memory
    once every client has trained, per job, and that as the job's resource client_state_mb
    (the config's FedAvg and FedProx keep none and are not listed)."""
    cfg = yaml.safe_load((repo_root / "config/config.yaml").read_text())
    cfg["experiments"] = cfg["experiments"][:1]
    cfg["experiments"][0]["methods"] = [{"name": "fedavg"}, {"name": "scaffold"}, {"name": "fedcurv"},
                                        {"name": "fedgp", "params": {"base": "fedcurv"}}, {"name": "agem"}]  # fmt: skip
    path = tmp_path / "kept.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["validate", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    kept = out.split("what clients keep across rounds (model copies; replay rows, exemplars, bases or class reports at their fullest), in "
                     "host memory per job (its resource client_state_mb: jobs packed in a submission run at once only as "
                     "many as fit its mem_mb):\n")[1]  # fmt: skip
    e = cfg["experiments"][0]
    clients = {p["clients"] for p in e["partitions"]}
    lines = kept.splitlines()
    assert len(lines) == 4 * len(clients) * len(e["datasets"]), lines
    n, k = 151_306, min(clients)  # cnn2d on digits, as listed above
    mb = -(-4 * n * k // 2**20)  # the train rule's resource, MiB rounded up
    assert f"  scaffold on cnn2d (digits [1, 8, 8]), {k} clients: 1 copy of the model per client, " \
           f"{byte_size(4 * n * k)} (client_state_mb {mb}) once all have trained" in lines  # fmt: skip
    # A-GEM's 200 rows of 64 float32 inputs, a label and a task (int64): 200 x 272 = 54,400 bytes
    assert f"  agem on cnn2d (digits [1, 8, 8]), {k} clients: at most 53.1 KiB of replay rows, exemplars, bases or class reports " \
           f"per client, {byte_size(54_400 * k)} (client_state_mb {-(-54_400 * k // 2**20)}) once all have trained" in lines  # fmt: skip
    both = 4 * n * 3 + 54_400  # FedGP over FedCurv: FedCurv's 3 copies and FedGP's own buffer of 200 rows
    assert f"  fedgp on cnn2d (digits [1, 8, 8]), {k} clients: 3 copies of the model and at most 53.1 KiB of replay " \
           f"rows, exemplars, bases or class reports per client, {byte_size(both * k)} (client_state_mb {-(-both * k // 2**20)}) " \
           "once all have trained" in lines  # fmt: skip


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1,023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                    (2**20 - 1, "1,024.0 KiB"), (5 * 2**30, "5.0 GiB"), (3 * 2**60, "3,072.0 PiB")])  # fmt: skip
def test_byte_size_names_the_largest_unit_reached(n, text):
    from fedforget.utils import byte_size

    assert byte_size(n) == text


def test_validate_bad_config_exit_2(capsys, tmp_path, repo_root):
    cfg = yaml.safe_load((repo_root / "config/config.yaml").read_text())
    cfg["experiments"][0]["partitions"][0]["alpha"] = -0.25
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["validate", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith("fedforget: error: invalid config")
    assert "experiments[0].partitions[0].alpha" in err and "-0.25" in err
    assert len(err.strip().splitlines()) <= 3
    assert "Traceback" not in err


def test_validate_missing_config_file(capsys, tmp_path):
    assert main(["validate", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_prepare_unknown_dataset_lists_allowed(capsys, tmp_path):
    assert main(["prepare", "--dataset", "nope", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'nope'" in err and "blobs, cifar10, cifar100, cinic10, digits" in err
    assert not any(tmp_path.iterdir())


def test_prepare_and_bad_options(capsys, tmp_path):
    assert (
        main(["prepare", "--dataset", "iris", "--options", '{"pca": 2}', "--root", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out.strip()
    assert out.endswith("iris-pca2")
    assert json.loads((tmp_path / "iris-pca2" / "meta.json").read_text())["input_shape"] == [2]
    assert (
        main(["prepare", "--dataset", "iris", "--options", "{pca: 2", "--root", str(tmp_path)]) == 2
    )
    assert "--options: not valid JSON" in capsys.readouterr().err
    assert main(["prepare", "--root", str(tmp_path)]) == 2
    assert "prepare needs --dataset" in capsys.readouterr().err


def test_plan_lists_36_run_dirs(capsys, repo_root):
    assert main(["plan", "--config", str(repo_root / "config/config.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(set(lines)) == 36  # embedded 18 + continual 18


def test_no_subcommand_is_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        main([])
    assert ei.value.code == 2


MISSING_PATH_CASES = {
    "validate": ["validate", "--config", "{m}"],
    "prepare": ["prepare", "--config", "{m}"],
    "prepare-public": ["prepare", "--public", '{{"source": "holdout", "fraction": 0.1, "seed": 0}}', "--of", "digits", "--root", "{m}"],
    "partition": ["partition", "--config", "{m}"],
    "partition-dataset": ["partition", "--dataset", "iris", "--spec", '{{"scheme": "iid", "clients": 3}}', "--out", "{m}/out", "--root", "{m}"],
    "train": ["train", "--config", "{m}"],
    "plan": ["plan", "--config", "{m}"],
    "aggregate": ["aggregate", "--config", "{m}"],
    "aggregate-runs": ["aggregate", "--runs", "{m}", "--out", "{m}/out", "--experiment", "x"],
    "plot": ["plot", "--summary", "{m}", "--out", "{m}/out"],
    "paper-table": ["paper-table", "--summary", "{m}", "--experiment", "x", "--paper", '{{"name": "p", "table": 1}}'],
    "figure": ["figure", "--summary", "{m}", "--experiment", "x", "--name", "curves", "--out", "{m}/x.png"],
    "run": ["run", "--config", "{m}"],
    "stale": ["stale", "--config", "{m}"],
}  # fmt: skip


def test_every_subcommand_names_a_missing_path_in_one_line(capsys, tmp_path):
    """Each subcommand that reads a path: exit 2, one line naming the path, no traceback;
    and every subcommand that takes a path is in the list."""
    from fedforget.cli import build_parser

    missing = tmp_path / "missing"
    for case, argv in MISSING_PATH_CASES.items():
        assert main([a.format(m=missing) for a in argv]) == 2, case
        err = capsys.readouterr().err
        assert err.startswith("fedforget: error: ") and str(missing) in err, (case, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (case, err)
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    takes_path = {
        name for name, p in sub.choices.items()
        if any(a.dest in ("config", "summary", "runs", "root") for a in p._actions)
    }  # fmt: skip
    assert takes_path <= {argv[0] for argv in MISSING_PATH_CASES.values()}


def test_every_option_has_help():
    from fedforget.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    for name, p in [("fedforget", parser), *sub.choices.items()]:
        for action in p._actions:
            if action.option_strings:
                assert action.help, f"{name} {action.option_strings[0]} has no help text"
    assert all(sub.choices[c].description or c for c in sub.choices)


def test_help_is_plain_text():
    """No reStructuredText markup (``literal``, :role:) in what --help prints (issue 35)."""
    from fedforget.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    for name, p in [("fedforget", parser), *sub.choices.items()]:
        text = p.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, name


def test_python_m_fedforget(tmp_path, capsys):
    import subprocess
    import sys

    from fedforget import __version__

    # the module runs the console script (a command that imports no torch: the listing
    # commands are tested in-process above)
    proc = subprocess.run([sys.executable, "-m", "fedforget", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["fedforget", __version__]
    # a user error's exit status and first words (in-process: a second interpreter start
    # costs seconds and tests nothing more)
    assert main(["plot", "--summary", str(tmp_path / "x"), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("fedforget: error:")


def test_a_batched_training_job_imports_no_dynamo_and_writes_the_same_bytes(make_run_config, tmp_path):
    """cli.skip_dynamo_import: `fedforget train` on the batched trainer does not import
    torch._dynamo (about 3 s of a small job's start) where torch.func itself does not (torch
    2.5's grad_and_value imports it; 2.11's and 2.14's do not), and writes what a run in this
    process, where torch is left as it is, writes."""
    import subprocess
    import sys

    probe = "import sys, torch; torch.func.grad_and_value(torch.sin); print('torch._dynamo' in sys.modules)"
    func_imports = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    expected = func_imports.stdout.split()[-1:]  # ['False'] or ['True'] (torch.func's own import)
    assert expected in (["False"], ["True"]), func_imports.stdout + func_imports.stderr

    from fedforget.runner import run_training
    from fedforget.utils import canonical_json

    rc = make_run_config(rounds=2, client_engine="vectorized", optimizer={"lr": 0.1, "momentum": 0.9})
    code = (
        "import sys; from fedforget.cli import main; rc = main(['train', '--config-json', sys.argv[1], "
        "'--out', sys.argv[2]]); print('torch._dynamo' in sys.modules, rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, canonical_json(rc.to_dict()), str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.stdout.split()[-2:] == [*expected, "0"], out.stdout + out.stderr
    run_training(rc, tmp_path / "here", progress=False)
    for name in ("metrics.csv", "tasks.csv", "accuracy_matrix.csv", "model.pt"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name


_MEMORY_PROBE = """
import ctypes, hashlib
import torch
from fedforget.cli import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
torch.set_num_threads(1)

def train():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8192, 16), torch.randint(0, 10, (8192,))
    base = mapped = libc.mallinfo2().hblks
    for _ in range(2):  # activations of 8192 x 2048 floats: 64 MB each, above glibc's mmap threshold
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        mapped = max(mapped, libc.mallinfo2().hblks)  # blocks mmap'd by malloc, live now (the saved activations)
        loss.backward()
        opt.step()
    return mapped - base, hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()

default = train()
kept = keep_freed_memory()
print(kept, *default, *train())
"""


def test_keep_freed_memory_serves_large_tensors_from_the_heap_with_the_same_results():
    """cli.keep_freed_memory (fedforget train's first step): with glibc, tensors of 64 MB
    come from the heap, not one new mmap each (mallinfo2's blocks during the steps), and
    training gives the same bits as before it (one process, the same steps twice)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    kept, mapped_default, digest_default, mapped_kept, digest_kept = done.stdout.split()
    if kept != "True":
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    assert int(mapped_default) > 0 and mapped_kept == "0", done.stdout
    assert digest_kept == digest_default


def test_what_torch_raises_is_told_apart():
    """An allocation torch cannot make, its size beyond 64 bits, is out of memory; a real that
    overflows a tensor's dtype or a double (math) is divergence (engine.Simulation.run); other
    errors are neither."""
    import math

    import torch

    from fedforget.utils import is_float_overflow, is_out_of_memory

    def raised(f):
        try:
            f()
        except Exception as e:
            return e
        raise AssertionError("no error")

    for f in (lambda: torch.zeros(10, 10**30), lambda: torch.empty(2**40, 2**40)):
        e = raised(f)
        assert is_out_of_memory(e) and not is_float_overflow(e), e
    for f in (lambda: torch.full((2,), 1e300), lambda: math.exp(1e5), lambda: 3e200**2):
        e = raised(f)
        assert is_float_overflow(e) and not is_out_of_memory(e), e
    for f in (lambda: torch.ones(2) @ torch.ones(3), lambda: torch.set_num_threads(10**12), lambda: int("x")):
        e = raised(f)
        assert not is_out_of_memory(e) and not is_float_overflow(e), e


def test_any_command_out_of_memory_ends_in_one_line(capsys, monkeypatch):
    """A command out of memory (numpy's MemoryError preparing a blobs set of 10**9 rows of
    4096x4096, torch's allocator, a tensor size torch cannot unpack): exit 2 and one line, not
    a traceback; other errors stay theirs."""
    import fedforget.cli as cli

    for err, line in [
        (MemoryError("Unable to allocate 59.6 PiB for an array with shape (1000000000, 1, 4096, 4096)"),
         "fedforget: error: fedforget datasets ran out of memory: Unable to allocate 59.6 PiB for an array"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes\nmore"),
         "fedforget: error: fedforget datasets ran out of memory: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes\n"),
        (TypeError("zeros(): argument 'size' failed to unpack the object at pos 2 with error \"Overflow when unpacking long long\nmore"),
         "fedforget: error: fedforget datasets ran out of memory: zeros(): argument 'size' failed to unpack"),
    ]:  # fmt: skip
        def fail(args, err=err):
            raise err

        monkeypatch.setattr(cli, "cmd_list", fail)
        assert main(["datasets"]) == 2
        assert capsys.readouterr().err.startswith(line)

    def other(args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(cli, "cmd_list", other)
    with pytest.raises(RuntimeError, match="shapes cannot"):
        main(["datasets"])
