"""Where a job runs (issue 18, item 4): `device: auto` takes the GPU a scheduler gives the job
(CUDA_VISIBLE_DEVICES is torch's business: it numbers the visible GPUs from 0), run.json
records the host, the GPU and the SLURM job, and a GPU picks the batched client engine. No
GPU here: CUDA is faked where torch would be asked about it."""

from __future__ import annotations

import json

import pytest
import torch

from fedforget.engine import resolve_device
from fedforget.runner import run_training, where_it_runs
from fedforget.utils import FedForgetError
from fedforget.vectorized import auto_prefers_sequential


def test_auto_is_cuda_when_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(FedForgetError, match="train.device='cuda:1' but no CUDA device"):
        resolve_device("cuda:1")


def test_a_gpu_trains_clients_batched_where_stacked_forward_runs_the_model() -> None:
    stacked = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU())
    assert auto_prefers_sequential(stacked, torch.device("cuda")) is None
    vmap_only = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4))
    why = auto_prefers_sequential(vmap_only, torch.device("cuda"))
    assert why == "auto on a GPU: sequential (module GroupNorm would need the vmap path, slower than a loop on a GPU)"


def test_run_json_records_the_gpu_and_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"NVIDIA H100 ({d})")
    host = where_it_runs(torch.device("cuda:0"))
    assert host["cuda_visible_devices"] == "3" and host["gpu"] == "NVIDIA H100 (cuda:0)"
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
