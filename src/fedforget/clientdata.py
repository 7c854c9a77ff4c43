"""A run's data on the training device: the private pool by client and task (the data of
client k in task t are one contiguous range of positions, so a client's minibatch is one
gather: no DataLoader, no per-sample Python), the test set with each task's rows, and the
public set for methods that use one. The task stream comes from the scenario
(``fedforget.data.scenario``); without one a run is its one-task case."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .data.scenario import Scenario
from .inputs import InputPipeline, Pool, occurrence
from .utils import host_to_device


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
    inputs: InputPipeline = InputPipeline()

    def size(self, k: int, t: int | None = None) -> int:
        """Client k's number of samples in task t (all tasks: None)."""
        o = self.offsets[k]
        return o[-1] - o[0] if t is None else o[t + 1] - o[t]

    @functools.cached_property
    def largest(self) -> int:
        """The most positions any client holds (every task): no view, and so no minibatch,
        is longer."""
        return max((o[-1] - o[0] for o in self.offsets), default=0)

    def draw_offset(self, rnd: int, epoch: int, epochs: int) -> int:
        """What a local training step adds to its positions so that ``batch`` augments its
        rows (0 without augmentation): the step's occurrence times the number of positions
        (``fedforget.inputs``: the key of a row's crop and flip)."""
        if self.inputs.augment is None:
            return 0
        return occurrence(rnd, epoch, epochs) * len(self.rows)

    @functools.cached_property
    def host_rows(self) -> torch.Tensor:
        """``rows`` in host memory (copied once): a streamed pool's gathers read it."""
        return self.rows.cpu()

    def batch(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the positions ``pos`` (any shape): the rows
        gathered, converted to model inputs, augmented where the positions carry a training
        step's ``draw_offset``, each seen through its task's transform.

        A streamed pool given host positions (the trainers' read-ahead, ``Pool.read_ahead``)
        finds its rows on the host and sends the indices to the device without blocking [D]:
        positions on the device would first have to come back to the host (``Pool.take``),
        and that copy waits for every step already queued on the device, so a read ahead of
        the steps could not start before they end."""
        draw = None
        if self.inputs.augment is not None:
            draw, pos = pos, pos % len(self.rows)
        if self.x.stream and pos.device.type == "cpu":
            r_host = self.host_rows[pos]
            x = self.x.take(r_host)
            dev = self.rows.device
            pos, r = host_to_device(pos, dev), host_to_device(r_host, dev)
            draw = None if draw is None else host_to_device(draw, dev)
        else:
            r = self.rows[pos]
            x = self.x.take(r)
        t = self.task[pos]
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
            x = self.scenario.transform(x, t, self.inputs.black(x.device))
        return x, self.y[r]

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

    def batch(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``pos`` of this view (0-based positions within it)."""
        return self.data.batch(pos + self.start)

    def empty(self) -> TaskView:
        """No rows, the same client and task (a reply that needs none, ``round_end_untrained``)."""
        return TaskView(self.data, self.start, self.start, self.task)

    def sample(self, m: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """min(m, len) rows drawn without replacement with ``generator`` (a CPU generator)."""
        pos = torch.randperm(len(self), generator=generator)[:m]
        return self.batch(pos.to(self.data.rows.device))

    def all(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(torch.arange(len(self), device=self.data.rows.device))


@dataclass
class TestSets:
    """The test split on the device and each task's rows of it (with its transform)."""

    x: torch.Tensor
    y: torch.Tensor
    rows: list[torch.Tensor]  # per task: long [M_t] rows of x
    black: torch.Tensor | None = None  # the model input of a black pixel (InputPipeline.black)

    def batches(self, t: int, scenario: Scenario, batch_size: int):
        """Task t's test rows in batches: (x seen through the task's transform, y)."""
        rows = self.rows[t]
        for s in range(0, len(rows), batch_size):
            r = rows[s : s + batch_size]
            yield scenario.transform(self.x[r], t, self.black), self.y[r]
