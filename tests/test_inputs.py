"""The data layer (fedforget.inputs): natural dtypes in the prepared format, their conversion
on the device, streamed pools equal to in-memory ones, and keyed on-device augmentation."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedforget.data import load_dataset, prepare_dataset
from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.inputs import InputPipeline, Pool, crop_flip, keyed_uniform_ints, prefetched
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError, host_to_device

from .conftest import thread_probe

CPU = torch.device("cpu")
BLOBS = {"num_train": 240, "num_test": 60, "channels": 3, "size": 8, "uint8": True}
CNN = {"channels": [4, 8], "hidden": 16}
AUG = {"kind": "crop_flip", "pad": 2}


@pytest.fixture(scope="module")
def blobs_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("blobs")
    prepare_dataset("blobs", BLOBS, root)
    return root


def _cfg(make_run_config, root, augment=None, **train):
    rc = make_run_config(
        dataset="blobs", options=BLOBS, model="cnn2d", model_options=CNN,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        **{"rounds": 2, "local_epochs": 2, "batch_size": 16, "eval_local_models": False, **train},
    )  # fmt: skip
    return replace(rc, data_dir=str(root), dataset=replace(rc.dataset, augment=augment))


def _run(rc, device: torch.device | None = CPU):
    """The run's metrics rows and its Simulation, on the CPU (None: the run's own device,
    FEDFORGET_TEST_DEVICE)."""
    sim = Simulation(rc, device=device)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS or k == "round"} for r in rows], sim


def test_prepare_keeps_uint8_and_records_channel_statistics(blobs_root):
    data = load_dataset(next(p.name for p in blobs_root.iterdir()), blobs_root)
    assert data.x_train.dtype == np.uint8 and data.x_train.shape == (240, 3, 8, 8)
    norm = data.meta["normalize"]
    x = data.x_train.astype(np.float64) / 255
    assert norm["scale"] == 255
    np.testing.assert_allclose(norm["mean"], x.mean(axis=(0, 2, 3)), atol=1e-6)
    np.testing.assert_allclose(norm["std"], x.std(axis=(0, 2, 3)), atol=1e-6)
    meta = json.loads((blobs_root / data.id / "meta.json").read_text())
    assert meta["files"]["x_train.npy"]["dtype"] == "uint8"


def test_float_inputs_pass_through_and_uint8_are_scaled_and_normalised():
    pipe = InputPipeline(255.0, (0.5, 0.25), (0.5, 2.0))
    x = torch.tensor([[[[0, 255]], [[51, 102]]]], dtype=torch.uint8)  # [1, 2, 1, 2]
    want = torch.tensor([[[[-1.0, 1.0]], [[(0.2 - 0.25) / 2, (0.4 - 0.25) / 2]]]])
    torch.testing.assert_close(pipe.convert(x), want)
    f = torch.randn(3, 4)
    assert pipe.convert(f) is f  # float features: untouched
    ids = torch.arange(6).view(1, 2, 3)
    assert pipe.convert(ids) is ids  # token ids: untouched


def test_crop_flip_is_a_window_of_the_padded_image_and_a_mirror():
    x = torch.arange(2 * 1 * 4 * 5, dtype=torch.float32).view(2, 1, 4, 5)
    draw = torch.tensor([11, 12])
    out = crop_flip(x, draw, salt=3, pad=1)
    dy, dx, flip = keyed_uniform_ints(draw, 3, 3)
    xp = torch.nn.functional.pad(x, (1, 1, 1, 1))
    for b in range(2):
        win = xp[b, :, int(dy[b] % 3) : int(dy[b] % 3) + 4, int(dx[b] % 3) : int(dx[b] % 3) + 5]
        want = win.flip(-1) if int(flip[b] % 2) else win
        assert torch.equal(out[b], want)
    # pad 0: only flips; keyed: the same draws give the same output, others differ
    same = crop_flip(x, draw, 3, 0)
    assert all(torch.equal(same[b], x[b]) or torch.equal(same[b], x[b].flip(-1)) for b in range(2))
    assert torch.equal(crop_flip(x, draw, 3, 1), out)
    many = torch.arange(400)
    d = keyed_uniform_ints(many, 5, 3)
    assert 0.4 < (d[2] % 2).float().mean() < 0.6  # flips about half the rows
    assert len(torch.unique(d[0] % 9)) == 9  # every offset occurs


@pytest.mark.parametrize("pad", [2, 3, 7])
def test_a_crop_reads_the_padded_image_without_making_it(pad):
    """Any pad, also beyond the image (7 > 4 rows): each crop is the window of the image
    padded with the fill, which is never made (a one-pixel border stands for the padding)."""
    x = torch.arange(64 * 2 * 4 * 5, dtype=torch.float32).view(64, 2, 4, 5)
    fill = torch.tensor([-1.0, -2.0]).view(2, 1, 1)
    draw = torch.arange(100, 164)
    out = crop_flip(x, draw, 3, pad, fill)
    dy, dx, flip = keyed_uniform_ints(draw, 3, 3)
    xp = fill.expand(64, 2, 4 + 2 * pad, 5 + 2 * pad).clone()
    xp[:, :, pad : pad + 4, pad : pad + 5] = x
    for b in range(64):
        y0, x0 = int(dy[b] % (2 * pad + 1)), int(dx[b] % (2 * pad + 1))
        win = xp[b, :, y0 : y0 + 4, x0 : x0 + 5]
        assert torch.equal(out[b], win.flip(-1) if int(flip[b] % 2) else win)
    huge = crop_flip(x, draw, 3, 10**12, fill)  # (allocated a 10**12-padded copy)
    assert torch.equal(huge, fill.expand_as(x))


def test_a_crop_pads_with_black_as_the_raw_image_is_padded_before_normalising():
    """torchvision's RandomCrop pads the raw image (0: black) before Normalize: the padded
    band is the model input of a stored 0, -mean/std per channel, and the image's own
    pixels are those of the unpadded conversion, bit for bit; replayed rows alike."""
    pipe = InputPipeline(255.0, (0.5, 0.25), (0.5, 2.0), {"kind": "crop_flip", "pad": 2}, seed=0)
    x = torch.full((64, 2, 3, 3), 200, dtype=torch.uint8)
    out = pipe.train_inputs(x, torch.arange(64))
    inside, black = pipe.convert(x)[0, :, 0, 0], pipe.convert(torch.zeros(1, 2, 1, 1, dtype=torch.uint8)).flatten()
    torch.testing.assert_close(black, torch.tensor([-1.0, -0.125]), rtol=0, atol=0)
    for c in range(2):
        values = set(out[:, c].flatten().tolist())
        assert values == {inside[c].item(), black[c].item()}  # some crops reach the band
    again = pipe.replay_inputs(pipe.convert(x), torch.arange(64), 7)
    assert {v for c in range(2) for v in again[:, c].flatten().tolist()} <= {*inside.tolist(), *black.tolist()}
    plain = InputPipeline(augment={"kind": "crop_flip", "pad": 2}).train_inputs(torch.ones(8, 1, 3, 3), torch.arange(8))
    assert set(plain.flatten().tolist()) <= {0.0, 1.0}  # not normalised: zeros


def test_host_to_device_is_the_same_tensor_on_a_cpu_and_a_copy_on_a_gpu():
    """utils.host_to_device: the indices a step sends to the device (a streamed pool's rows,
    replayed rows) go from pinned memory without blocking on a GPU; on a CPU nothing moves."""
    t = torch.arange(5)
    assert host_to_device(t, CPU) is t
    if torch.cuda.is_available():  # gpu.sh runs this file's device tests
        d = host_to_device(t, torch.device("cuda"))
        assert d.device.type == "cuda" and torch.equal(d.cpu(), t)
        assert host_to_device(d, torch.device("cuda")) is d


def test_host_to_device_refuses_a_copy_into_a_capturing_cuda_stream(monkeypatch):
    """A pinned copy without blocking would be captured into a CUDA graph, every replay then
    reading the capture's host buffer: refused (found by reading, the CPU tape sees no
    copy); the capture's state is stood in for on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="a host-to-device copy in a captured step"):
        host_to_device(torch.arange(3), torch.device("cuda"))
    assert host_to_device(t := torch.arange(3), CPU) is t  # a CPU run is no capture


def test_streamed_pool_gathers_the_same_rows(blobs_root, tmp_path):
    data = load_dataset(next(p.name for p in blobs_root.iterdir()), blobs_root, mmap=True)
    assert isinstance(data.x_train, np.memmap)
    rows = torch.tensor([[5, 3, 5], [0, 239, 3]])
    dev, stream = Pool(data.x_train, CPU, False), Pool(data.x_train, CPU, True)
    assert torch.equal(dev.take(rows), stream.take(rows))
    assert stream.take(rows).shape == (2, 3, 3, 8, 8)


@pytest.mark.parametrize("augment", [None, AUG])
def test_streamed_run_equals_in_memory_run(make_run_config, blobs_root, augment):
    rows_dev, _ = _run(_cfg(make_run_config, blobs_root, augment, data_storage="device"))
    rows_stream, sim = _run(_cfg(make_run_config, blobs_root, augment, data_storage="stream"))
    assert sim.clients.x.stream and rows_stream == rows_dev


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_read_ahead_gives_the_in_memory_run(make_run_config, blobs_root, monkeypatch, engine):
    """A streamed pool on a GPU reads minibatches ahead on a thread (Pool.read_ahead), in
    both engines; forced on here: the same run as in memory, every step's gather read ahead,
    from positions in host memory (on a GPU, device positions would make the reading thread
    wait for the queued steps: ClientData.batch; on a CPU every tensor is a host tensor, so
    that part of the check bites where gpu.sh runs it, FEDFORGET_TEST_DEVICE=cuda)."""
    import threading

    import fedforget.trainers
    import fedforget.vectorized
    from fedforget.clientdata import ClientData

    monkeypatch.setattr(fedforget.vectorized, "LOOP_MIN_ROWS", 10**9)  # every step batched, as on a GPU
    rows_dev, _ = _run(_cfg(make_run_config, blobs_root, AUG, client_engine=engine), None)
    reads: list[int] = []

    def counted(fetch, items, ahead=2):
        reads.append(len(items))
        return prefetched(fetch, items, ahead)

    read_from: set[str] = set()  # the devices of the positions the reading thread was given
    plain_batch = ClientData.batch

    def batch(self, pos):
        if threading.current_thread() is not threading.main_thread():
            read_from.add(pos.device.type)
        return plain_batch(self, pos)

    monkeypatch.setattr(Pool, "read_ahead", property(lambda self: self.stream))
    monkeypatch.setattr(ClientData, "batch", batch)
    for mod in (fedforget.trainers, fedforget.vectorized):
        monkeypatch.setattr(mod, "prefetched", counted)
    rows_ahead, sim = _run(_cfg(make_run_config, blobs_root, AUG, client_engine=engine, data_storage="stream"), None)
    assert sim.trainer.name == engine and sum(reads) > 0
    assert read_from == {"cpu"}
    assert rows_ahead == rows_dev


def test_read_ahead_computes_on_the_callers_threads():
    """The reading thread runs its fetches on the caller's intra-op count (OpenMP's and MKL's
    are per thread): a new thread ran MKL's products on every core, with other bits for some
    small shapes (an MLP of 4 -> 64 -> 64 on 5-11 rows on a 2-core CPU; on lanes the caller's
    count is a lane's share, trainers.LocalTrainer.at_once; tests/conftest.py thread_probe)."""
    mlp, rows = thread_probe()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            here = [mlp(x) for x in rows]
            ahead = list(prefetched(mlp, rows))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(here, ahead, strict=True))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_streamed_steps_replay_as_cuda_graphs_bit_for_bit(make_run_config, blobs_root, monkeypatch, device):
    """A streamed pool's minibatches, read ahead on a thread, are copied into the captured
    steps' inputs at each replay: the same weights as the in-memory pool's eager steps (on a
    CPU through the tape, whose pool reads ahead as on a GPU; batch 8: steps a CPU batches)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU (benchmarks/gpu.sh runs this where one is)")
    weights = []
    for flag, storage in (("0", "device"), ("1" if device == "cuda" else "tape", "stream")):
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        rc = _cfg(make_run_config, blobs_root, AUG, client_engine="vectorized", rounds=3, device=device,
                  batch_size=16 if device == "cuda" else 8, data_storage=storage)  # fmt: skip
        sim = Simulation(rc, device=torch.device(device))
        status, _, msg = sim.run(progress=False)
        assert status == "completed", msg
        assert sim.clients.x.read_ahead == (storage == "stream")
        assert storage == "device" or sim.trainer.step_graphs.replays > 0
        weights.append(sim.global_params)
    for k, v in weights[0].items():
        assert torch.equal(v, weights[1][k]), k


def test_augmentation_changes_training_and_both_engines_augment_alike(make_run_config, blobs_root):
    plain, _ = _run(_cfg(make_run_config, blobs_root))
    seq, sim = _run(_cfg(make_run_config, blobs_root, AUG))
    assert sim.clients.inputs.augment == AUG
    assert seq[-1]["global_model_test_loss"] != plain[-1]["global_model_test_loss"]
    vec, vsim = _run(_cfg(make_run_config, blobs_root, AUG, client_engine="vectorized"))
    assert vsim.trainer.name == "vectorized"
    for a, b in zip(seq, vec):
        assert a["global_model_test_loss"] == pytest.approx(b["global_model_test_loss"], abs=1e-5)


def test_training_rows_are_augmented_per_occurrence_and_other_reads_are_not(make_run_config, blobs_root):
    sim = Simulation(_cfg(make_run_config, blobs_root, AUG), device=CPU)
    cd = sim.clients
    pos = torch.arange(8)
    plain = cd.batch(pos)[0]
    r1 = cd.batch(pos + cd.draw_offset(1, 0, 2))[0]
    r1b = cd.batch(pos + cd.draw_offset(1, 0, 2))[0]
    r2 = cd.batch(pos + cd.draw_offset(1, 1, 2))[0]
    assert torch.equal(plain, cd.inputs.convert(cd.x.take(cd.rows[pos])))  # no training step: as stored
    assert torch.equal(r1, r1b) and not torch.equal(r1, r2) and not torch.equal(r1, plain)
    assert cd.draw_offset(1, 0, 2) == len(cd.rows)  # occurrence 1


def test_augment_config_errors_name_the_key(minimal_config):
    minimal_config["experiments"][0]["datasets"][0]["augment"] = {"kind": "crop_flip"}
    with pytest.raises(FedForgetError, match=r"datasets\[0\]\.augment.*images"):
        parse_config(minimal_config)  # iris: features, not images
    minimal_config["experiments"][0]["datasets"][0] = {
        "name": "digits", "model": "cnn2d", "augment": {"kind": "crop_flip", "pad": 2},
    }  # fmt: skip
    wf = parse_config(minimal_config)
    rc = wf.runs()[0]
    assert rc.dataset.augment == {"kind": "crop_flip", "pad": 2}
    minimal_config["experiments"][0]["datasets"][0]["augment"] = {"kind": "none"}
    none = parse_config(minimal_config).runs()[0]
    assert none.dataset.augment is None and "augment" not in none.to_dict()["dataset"]
    assert none.hash != rc.hash
    minimal_config["experiments"][0]["train"] = {"data_storage": "stream"}
    assert parse_config(minimal_config).runs()[0].hash == none.hash  # a runtime setting


def test_normalize_replaces_the_datasets_statistics(minimal_config, make_run_config, blobs_root):
    """dataset.normalize ({mean, std} per channel, e.g. the FedSOL code's 0.5 / 0.5): the
    images are normalised by it instead of the training split's statistics, the crop pads
    with its black; part of the run's identity where set, absent otherwise; a wrong channel
    count, a std <= 0 or features are errors naming the key."""
    rc = _cfg(make_run_config, blobs_root)
    half = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}
    own = Simulation(rc, device=CPU).clients
    set_ = Simulation(replace(rc, dataset=replace(rc.dataset, normalize=half, augment=AUG)), device=CPU).clients
    raw = own.x.take(own.rows[:4])
    torch.testing.assert_close(set_.inputs.convert(raw), raw.float() / 255 * 2 - 1)
    assert own.inputs.mean != set_.inputs.mean
    assert torch.equal(set_.inputs.black(CPU).flatten(), torch.full((3,), -1.0))
    minimal_config["experiments"][0]["datasets"][0] = {"name": "blobs", "options": {"size": 8, "uint8": True}, "model": "cnn2d"}
    plain = parse_config(minimal_config).runs()[0]
    assert "normalize" not in plain.to_dict()["dataset"]
    minimal_config["experiments"][0]["datasets"][0]["normalize"] = {"mean": [0.5], "std": [0.5]}
    assert parse_config(minimal_config).runs()[0].hash != plain.hash
    for bad, msg in (({"mean": [0.5, 0.5], "std": [0.5]}, r"normalize\.mean=\[0\.5, 0\.5\]; allowed: a list of 1 finite"),
                     ({"mean": [0.5], "std": [0.0]}, r"normalize\.std\[0\]: 0\.0 is less than or equal to the minimum of 0; allowed: a finite number > 0")):  # fmt: skip
        minimal_config["experiments"][0]["datasets"][0]["normalize"] = bad
        with pytest.raises(FedForgetError, match=msg):
            parse_config(minimal_config)
    minimal_config["experiments"][0]["datasets"][0] = {"name": "iris", "model": "mlp", "normalize": half}
    with pytest.raises(FedForgetError, match=r"datasets\[0\]\.normalize needs images"):
        parse_config(minimal_config)
    minimal_config["experiments"][0]["datasets"][0] = {"name": "digits", "model": "cnn2d", "normalize": {"mean": [0.5], "std": [0.5]}}
    with pytest.raises(FedForgetError, match=r"datasets\[0\]\.normalize is for datasets stored as uint8 images"):
        parse_config(minimal_config)  # digits: float features, refused before any job (not in the job's pipeline)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_augmented_steps_replay_as_cuda_graphs_bit_for_bit(make_run_config, blobs_root, monkeypatch, device):
    """The augmentation key travels inside the step's positions, so a captured step replays
    each round's own crops and flips: graphs on and off give the same weights. On a CPU
    through the tape (fedforget.cudagraph), at batch 8: steps a CPU batches."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU (benchmarks/gpu.sh runs this where one is)")
    rc = _cfg(make_run_config, blobs_root, AUG, client_engine="vectorized", rounds=4, device=device,
              batch_size=16 if device == "cuda" else 8)  # fmt: skip
    weights = []
    for flag in ("1" if device == "cuda" else "tape", "0"):
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        sim = Simulation(rc, device=torch.device(device))
        assert (sim.trainer.step_graphs is not None) == (flag != "0")
        status, _, msg = sim.run(progress=False)
        assert status == "completed", msg
        assert flag == "0" or sim.trainer.step_graphs.replays > 0
        weights.append(sim.global_params)
    for k, v in weights[0].items():
        assert torch.equal(v, weights[1][k]), k


@pytest.mark.parametrize("boundaries", ["sync", {"samples_per_window": 40, "window_rounds": 1}])
def test_targets_pool_is_normalised_as_the_data_whatever_the_boundaries(make_run_config, blobs_root, monkeypatch,
                                                                        boundaries):  # fmt: skip
    """TARGET's generator makes model inputs by the dataset's normalisation constants
    (``RunInfo.normalize``); they came in the clients' task-end replies, and under
    asynchronous boundaries a task end that no client had moved past had none: its pool went
    unnormalised (found in review)."""
    from fedforget.methods.synthesis import Synthesizer

    from .methods.test_concurrent_clients import TINY_TARGET

    seen, real = [], Synthesizer.__init__

    def init(self, *args, **kw):
        real(self, *args, **kw)
        seen.append(self.normalize)

    monkeypatch.setattr(Synthesizer, "__init__", init)
    scenario = {"kind": "split", "tasks": 2, "classes_per_task": 2, "rounds_per_task": 1, "leftover_classes": "drop",
                "boundaries": boundaries}  # fmt: skip
    rc = _cfg(make_run_config, blobs_root, method="target", params=TINY_TARGET, scenario=scenario, local_epochs=1)
    _run(rc)
    meta = load_dataset(next(p.name for p in blobs_root.iterdir()), blobs_root).meta["normalize"]
    assert len(seen) == 1 and seen[0] is not None
    torch.testing.assert_close(seen[0][0].flatten().double(), torch.tensor(meta["mean"], dtype=torch.float64))
