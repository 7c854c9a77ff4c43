"""A run's data, loaded for training: the prepared dataset split over clients by the run's
partition and task stream (``fedforget.clientdata``'s ClientData), its test sets and public
set, on the training device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .clientdata import ClientData, TestSets
from .config import RunConfig
from .data import PublicSet, load_dataset, load_public
from .data.base import domain_ids
from .data.scenario import Scenario
from .inputs import InputPipeline, Pool, choose_storage
from .partition import client_indices, load_partition, partition_dataset
from .utils import FedForgetError, torch_seed

EVAL_ORDER_STREAM = 0x5C  # keyed order of each task's test rows (train.eval_order: shuffled)


@dataclass
class RunData:
    clients: ClientData
    test: TestSets
    public: PublicSet | None  # its arrays moved to the device
    num_classes: int
    input_shape: tuple[int, ...]
    scenario: Scenario
    class_names: tuple[str, ...] = ()  # the dataset's (meta.json)


def load_run_data(
    cfg: RunConfig, device: torch.device, public_labels: bool, verify: bool = True
) -> RunData:
    """The prepared dataset split over clients by the run's partition (the file the workflow
    wrote, checked against the config; without the workflow the same deterministic partition
    is drawn in memory), moved to ``device``. ``public_labels``: whether the method may see
    the public set's labels."""
    data = load_dataset(cfg.dataset.id, cfg.data_dir, verify, mmap=True)
    stream = choose_storage(cfg.train.data_storage, data.x_train.nbytes, device)
    inputs = InputPipeline.of(data.meta, cfg.dataset.augment, cfg.seed, cfg.dataset.normalize)
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
        assignment = partition_dataset(data, cfg.partition, excluded)
    if len(assignment) != len(data.y_train):
        raise FedForgetError(
            f"partition {cfg.partition_dir} has {len(assignment)} rows, dataset '{data.id}' {len(data.y_train)}"
        )
    sc = Scenario.build(cfg.dataset.scenario, data.num_classes, data.input_shape, cfg.train.rounds)
    dom_train = domain_ids(data.meta, "train")  # None but for a multi-domain dataset
    in_task = [sc.rows_of_task(data.y_train, t, dom_train) for t in range(sc.tasks)]
    rows, tasks, offsets = [], [], []
    pos = 0
    for idx in client_indices(assignment, cfg.partition.clients):
        o = [pos]
        for t in range(sc.tasks):
            r = idx[in_task[t][idx]]
            rows.append(r)
            tasks.append(np.full(len(r), t, dtype=np.int64))
            pos += len(r)
            o.append(pos)
        offsets.append(o)
    sc.check_windows(offsets, cfg.train.rounds)
    clients = ClientData(
        Pool(data.x_train, device, stream),
        torch.as_tensor(data.y_train, device=device),
        torch.as_tensor(np.concatenate(rows), device=device),
        torch.as_tensor(np.concatenate(tasks), device=device),
        offsets,
        sc,
        inputs,
    )
    # the test split and the public set are held as model inputs (converted once)
    dom_test = domain_ids(data.meta, "test")
    task_rows = [torch.as_tensor(np.flatnonzero(sc.rows_of_task(data.y_test, t, dom_test))) for t in range(sc.tasks)]
    if cfg.train.eval_order == "shuffled":  # each task's rows in a keyed order (seed, task) [C: FedProTIP's shuffled test loaders]
        task_rows = [
            r[torch.randperm(len(r), generator=torch.Generator().manual_seed(torch_seed(cfg.seed, t, EVAL_ORDER_STREAM)))]
            for t, r in enumerate(task_rows)
        ]
    test = TestSets(
        inputs.convert(torch.as_tensor(np.asarray(data.x_test), device=device)),
        torch.as_tensor(data.y_test, device=device),
        [r.to(device) for r in task_rows],
        inputs.black(device),
    )
    if public is not None:
        public.x = inputs.convert(torch.as_tensor(np.asarray(public.x), device=device))
        if public.y is not None:
            public.y = torch.as_tensor(public.y, device=device)
    return RunData(clients, test, public, data.num_classes, data.input_shape, sc, tuple(data.class_names))
