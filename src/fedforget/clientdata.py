"""A run's data on the training device: the private pool sorted by client (client k owns one
contiguous slice, so a client's minibatch is one gather: no DataLoader, no per-sample
Python), the test set, and the public set for methods that use one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import RunConfig
from .data import PublicSet, load_dataset, load_public
from .partition import client_indices, load_partition, make_partition
from .utils import FedForgetError


@dataclass
class ClientData:
    """Training data sorted by client: client k owns rows offsets[k]:offsets[k+1]."""

    x: torch.Tensor
    y: torch.Tensor
    offsets: list[int]

    def size(self, k: int) -> int:
        return self.offsets[k + 1] - self.offsets[k]

    def slice(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[k], self.offsets[k + 1]
        return self.x[a:b], self.y[a:b]


@dataclass
class RunData:
    clients: ClientData
    x_test: torch.Tensor
    y_test: torch.Tensor
    public: PublicSet | None  # its arrays moved to the device
    num_classes: int
    input_shape: tuple[int, ...]


def load_run_data(cfg: RunConfig, device: torch.device, public_labels: bool, verify: bool = True) -> RunData:
    """The prepared dataset split over clients by the run's partition (the file the workflow
    wrote, checked against the config; without the workflow the same deterministic partition
    is drawn in memory), moved to ``device``. ``public_labels``: whether the method may see
    the public set's labels."""
    data = load_dataset(cfg.dataset.id, cfg.data_dir, verify)
    public = load_public(cfg.dataset.public, cfg.dataset.id, cfg.data_dir, public_labels, verify)
    if cfg.partition_dir.joinpath("meta.json").exists():
        assignment, meta = load_partition(cfg.partition_dir)
        if meta["spec"] != cfg.partition.to_dict() or meta["dataset"] != cfg.dataset.id:
            raise FedForgetError(
                f"partition {cfg.partition_dir} was made for {meta['dataset']} {meta['spec']}, "
                f"not {cfg.dataset.id} {cfg.partition.to_dict()}; delete it to redraw"
            )
    else:  # usable without the workflow: the same deterministic partition, in memory
        excluded = public.excluded_train_rows if public is not None else None
        assignment = make_partition(data.y_train, cfg.partition, excluded)
    if len(assignment) != len(data.y_train):
        raise FedForgetError(
            f"partition {cfg.partition_dir} has {len(assignment)} rows, dataset '{data.id}' {len(data.y_train)}"
        )
    idx = client_indices(assignment, cfg.partition.clients)
    order = np.concatenate(idx)
    clients = ClientData(
        torch.as_tensor(data.x_train[order], device=device),
        torch.as_tensor(data.y_train[order], device=device),
        [0, *np.cumsum([len(i) for i in idx]).tolist()],
    )
    if public is not None:
        public.x = torch.as_tensor(public.x, device=device)
        if public.y is not None:
            public.y = torch.as_tensor(public.y, device=device)
    return RunData(
        clients,
        torch.as_tensor(data.x_test, device=device),
        torch.as_tensor(data.y_test, device=device),
        public,
        data.num_classes,
        data.input_shape,
    )
