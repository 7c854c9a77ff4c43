"""A run's data on the training device: the private pool by client and task (the data of
client k in task t are one contiguous range of positions, so a client's minibatch is one
gather: no DataLoader, no per-sample Python), the test set with each task's rows, and the
public set for methods that use one. The task stream comes from the scenario
(``fedforget.data.scenario``); without one a run is its one-task case."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import RunConfig
from .data import PublicSet, load_dataset, load_public
from .data.base import domain_ids
from .data.scenario import Scenario
from .inputs import InputPipeline, Pool, choose_storage, occurrence
from .partition import client_indices, load_partition, make_partition
from .utils import FedForgetError


@dataclass
class ClientData:
    """Training data by client and task. ``x``: the training split's inputs in their stored
    dtype (``fedforget.inputs.Pool``: on the device, or streamed from a memory map), ``y``
    its labels on the device, in its own order; ``rows``: positions -> rows of x, sorted by
    client, then by task (a client's rows keep the partition's order within a task), so the
    data of client k in task t are the contiguous positions ``offsets[k][t]`` ..
    ``offsets[k][t + 1] - 1`` and a minibatch is one gather of rows (no DataLoader, no
    per-sample Python); ``task``: each position's task. A domain-incremental scenario lists
    a row once per task (its transform differs), without copying it. ``inputs`` turns the
    gathered rows into model inputs (``fedforget.inputs.InputPipeline``)."""

    x: Pool
    y: torch.Tensor
    rows: torch.Tensor  # long [P]
    task: torch.Tensor  # long [P]
    offsets: list[list[int]]  # [K][T + 1]
    scenario: Scenario
    class_mask: torch.Tensor | None  # bool [T, C] where the scenario masks logits, else None
    inputs: InputPipeline = InputPipeline()

    def size(self, k: int, t: int | None = None) -> int:
        """Client k's number of samples in task t (all tasks: None)."""
        o = self.offsets[k]
        return o[-1] - o[0] if t is None else o[t + 1] - o[t]

    def draw_offset(self, rnd: int, epoch: int, epochs: int) -> int:
        """What a local training step adds to its positions so that ``batch`` augments its
        rows (0 without augmentation): the step's occurrence times the number of positions
        (``fedforget.inputs``: the key of a row's crop and flip)."""
        if self.inputs.augment is None:
            return 0
        return occurrence(rnd, epoch, epochs) * len(self.rows)

    def batch(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, y, logit mask or None) of the positions ``pos`` (any shape): the rows
        gathered, converted to model inputs, augmented where the positions carry a training
        step's ``draw_offset``, each seen through its task's transform."""
        draw = None
        if self.inputs.augment is not None:
            draw, pos = pos, pos % len(self.rows)
        r = self.rows[pos]
        x, t = self.x.take(r), self.task[pos]
        if draw is None:
            x = self.inputs.convert(x)
        else:
            lead = pos.shape
            flat = x.reshape(-1, *x.shape[len(lead):])
            aug = self.inputs.train_inputs(flat, draw.reshape(-1))
            plain = self.inputs.convert(flat)
            train_step = (draw.reshape(-1) >= len(self.rows)).view(-1, *([1] * (flat.dim() - 1)))
            x = torch.where(train_step, aug, plain).view(*lead, *aug.shape[1:])
        if self.scenario.transforms:
            x = self.scenario.transform(x, t)
        return x, self.y[r], None if self.class_mask is None else self.class_mask[t]

    def slice(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of all of client k's positions, every task, converted, untransformed."""
        r = self.rows[self.offsets[k][0] : self.offsets[k][-1]]
        return self.inputs.convert(self.x.take(r)), self.y[r]

    def view(self, k: int, rnd: int, all_tasks: bool = False) -> TaskView:
        """Client k's data in round ``rnd``: its rows of the round's task (synchronous
        boundaries), or its window of its stream (asynchronous); ``all_tasks``: every task's
        rows (joint training)."""
        sc, o = self.scenario, self.offsets[k]
        if all_tasks:
            return TaskView(self, o[0], o[-1], sc.task_of_round(rnd))
        if sc.window is None:
            t = sc.task_of_round(rnd)
            return TaskView(self, o[t], o[t + 1], t)
        per, _ = sc.window
        n = o[-1] - o[0]
        a = min(sc.window_of_round(rnd) * per, max(n - per, 0))
        b = min(a + per, n)
        last = o[0] + max(b - 1, 0)
        t = int(self.task[last]) if n else sc.task_of_round(rnd)
        return TaskView(self, o[0] + a, o[0] + b, t)

    def task_view(self, k: int, t: int) -> TaskView:
        """Client k's whole data of task t."""
        return TaskView(self, self.offsets[k][t], self.offsets[k][t + 1], t)


@dataclass
class TaskView:
    """A client's training data for one round or one task: positions start..stop-1 of its
    ``ClientData``; ``task``: the client's task (its newest sample's, asynchronously)."""

    data: ClientData
    start: int
    stop: int
    task: int

    def __len__(self) -> int:
        return self.stop - self.start

    def batch(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows ``pos`` of this view (0-based positions within it)."""
        return self.data.batch(pos + self.start)

    def sample(
        self, m: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """min(m, len) rows drawn without replacement with ``generator`` (a CPU generator)."""
        pos = torch.randperm(len(self), generator=generator)[:m]
        return self.batch(pos.to(self.data.rows.device))

    def all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.batch(torch.arange(len(self), device=self.data.rows.device))


@dataclass
class TestSets:
    """The test split on the device and each task's rows of it (with its transform)."""

    x: torch.Tensor
    y: torch.Tensor
    rows: list[torch.Tensor]  # per task: long [M_t] rows of x

    def batches(self, t: int, scenario: Scenario, batch_size: int):
        """Task t's test rows in batches: (x seen through the task's transform, y)."""
        rows = self.rows[t]
        for s in range(0, len(rows), batch_size):
            r = rows[s : s + batch_size]
            yield scenario.transform(self.x[r], t), self.y[r]


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
    inputs = InputPipeline.of(data.meta, cfg.dataset.augment, cfg.seed)
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
    clients = ClientData(
        Pool(data.x_train, device, stream),
        torch.as_tensor(data.y_train, device=device),
        torch.as_tensor(np.concatenate(rows), device=device),
        torch.as_tensor(np.concatenate(tasks), device=device),
        offsets,
        sc,
        sc.class_mask(device) if sc.masked else None,
        inputs,
    )
    # the test split and the public set are held as model inputs (converted once)
    dom_test = domain_ids(data.meta, "test")
    test = TestSets(
        inputs.convert(torch.as_tensor(np.asarray(data.x_test), device=device)),
        torch.as_tensor(data.y_test, device=device),
        [
            torch.as_tensor(np.flatnonzero(sc.rows_of_task(data.y_test, t, dom_test)), device=device)
            for t in range(sc.tasks)
        ],
    )
    if public is not None:
        public.x = inputs.convert(torch.as_tensor(np.asarray(public.x), device=device))
        if public.y is not None:
            public.y = torch.as_tensor(public.y, device=device)
    return RunData(clients, test, public, data.num_classes, data.input_shape, sc, tuple(data.class_names))
