"""A per-client replay buffer filled by reservoir sampling: the memory of FL+A-GEM, FL+DER
(``agem.py``, ``der.py``) and FedGP (papers/fedgp.md). Not a method; methods use it.

Reservoir sampling [P, fedgp.md Algorithm 4, Vitter 1985] with capacity B: the n-th sample
offered (n = 0, 1, ... counted over everything the client was ever offered) is stored at
slot n while n < B; otherwise j ~ U{0, ..., n} is drawn and the sample replaces slot j if
j < B. After N offers every sample is in the buffer with probability min(1, B / N)
(fedgp.md App. C), whatever the order of the offers.

What is stored, per row: ``x`` as the model sees it (after the task's transform: rotated or
permuted inputs are stored rotated or permuted), ``y``, the row's ``task`` and any extra
tensors the method passes (DER: the logits of the training forward, ``logits``). Everything
lives in the client's ``ctx.state[key]`` (a plain dict of tensors and ints: checkpointed with
the run, moved to host memory between the client's rounds on a GPU), one buffer per key;
methods that share a key share the buffer (FedGP over DER or A-GEM reuses the base's).

When a sample is offered [D, per METHODS.md "FedGP"]: once per task, during the client's
first pass over the task's data, i.e. the first local epoch of the first round in which it
trains on the task (a client not sampled in the task's first round offers in its first
sampled round), after the step that trained on it. FedGP's code offers each sample once, on
its first pass; Algorithm 2 read literally would offer it at every step (every epoch of
every round). ``offer_budget`` implements the rule: the buffer keeps ``offered_upto``, the
end of the newest data range it was offered from (a client's rows are contiguous and
ordered by task), so a round whose data end beyond it offers its first epoch. With
asynchronous boundaries that is the first round of each new window. A window clipped to the
end of a client's stream overlaps the one before it and is offered whole: its rows that the
earlier window offered are offered a second time (this said "not offered" before
2026-12-06; found in review: it happens wherever a client's stream ends before the run's
last window; offering only the rows past ``offered_upto`` is not built).

Randomness is keyed, never sequential [D]: the offers of client k in round r (on task t)
draw from ``offer_generator`` = torch_seed(seed, r, k, t, OFFER_STREAM); a method's memory
batches from its own stream (``sample_generator``), so changing a batch size never changes
the buffer's contents. The draws for a minibatch of m offers are m float64 uniforms u,
j = floor(u (n + 1)) (one draw per offered row, used or not; bias below 2^-53).

A-GEM and DER make these draws for a whole round at the client's start (``ReplayPlan``, from
what the buffer will hold at each step), the same draws in the same order, so that their
steps do no host work and run inside CUDA graphs [D].
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from ..utils import host_to_device, on_device, torch_seed
from .base import PlannedTerms
from .shared import StepDraws, padded, rows_mask

if TYPE_CHECKING:  # pragma: no cover
    from ..data.scenario import Scenario
    from ..train_spec import TrainSpec
    from .base import ClientContext, ClientShape, RunInfo, StepTerms

OFFER_STREAM = 0x80  # keyed randomness of the reservoir's replacement draws
KEY = "replay"  # default ctx.state key of the buffer
_META = ("size", "seen", "offered_upto")  # the buffer's int fields; the rest are row tensors


POLICIES = ("reservoir", "random", "sliding")  # buffer updates compared in FedGP Table 9


class Reservoir:
    """A buffer of ``capacity`` rows in a client's state dict under ``key``. The object
    itself holds no data (one is shared by all clients, like the method): every call takes
    the client's ``state`` (``ctx.state``).

    ``policy``: how a row offered to a full buffer is placed [P, fedgp.md Sec. 5.2, Table 9]:
    ``reservoir`` (Algorithm 4, above), ``random`` ("randomly replaces a data point in the
    buffer": every row offered to a full buffer replaces slot floor(u B)), ``sliding``
    ("replaces the earliest data point": slot n mod B, a ring in arrival order). All three
    store at slot n while n < B and draw one uniform u per offered row, used or not."""

    def __init__(self, capacity: int, key: str = KEY, policy: str = "reservoir") -> None:
        if policy not in POLICIES:
            raise ValueError(f"buffer policy={policy!r}; allowed: {', '.join(POLICIES)}")
        self.capacity = int(capacity)
        self.key = key
        self.policy = policy

    # ------------------------------------------------------------------ reading
    def size(self, state: dict[str, Any]) -> int:
        """Rows in the buffer (min(seen, capacity)); 0 before the first offer."""
        buf = state.get(self.key)
        return 0 if buf is None else int(buf["size"])

    def seen(self, state: dict[str, Any]) -> int:
        """Samples offered so far (n of Algorithm 4)."""
        buf = state.get(self.key)
        return 0 if buf is None else int(buf["seen"])

    def rows(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The buffer's filled rows: {"x", "y", "task", extras...} (views, not copies)."""
        buf = state.get(self.key)
        if buf is None:
            return {}
        n = int(buf["size"])
        return {k: v[:n] for k, v in buf.items() if k not in _META}

    def sample(
        self, state: dict[str, Any], m: int, generator: torch.Generator
    ) -> dict[str, torch.Tensor] | None:
        """min(m, size) rows drawn uniformly without replacement with ``generator`` (a CPU
        generator): {"x", "y", "task", extras...}; None while the buffer is empty."""
        n = self.size(state)
        if n == 0:
            return None
        buf = state[self.key]
        # drawn on the host (the keyed CPU generator), sent without blocking (a blocking copy
        # would wait for the queued work): FedGP's buffer batches; A-GEM's and DER's steps
        # read theirs from a ReplayPlan, which draws them as this does
        idx = host_to_device(torch.randperm(n, generator=generator)[:m], buf["y"].device)
        return {k: v[idx] for k, v in buf.items() if k not in _META}

    # ------------------------------------------------------------------ writing
    def offer(
        self,
        state: dict[str, Any],
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        task: torch.Tensor | int,
        rows: int | None = None,
        **extra: torch.Tensor,
    ) -> int:
        """Offer the rows of a minibatch, in order, to the reservoir (Algorithm 4, one row
        after another: a slot drawn twice keeps the later row). ``task``: the rows' task
        (one id or one per row); ``rows``: the most rows the client will ever offer, where
        known (``rows_for``); ``extra``: more per-row tensors to keep (DER's logits; the
        same names at every offer). Returns the number of rows stored."""
        m = len(y)
        if m == 0 or self.capacity == 0:
            return 0
        fields = self.fields(x, y, task, extra)
        buf = self.rows_for(state, fields, rows)
        seen = int(buf["seen"])
        slot_of_row = self.places(seen, m, generator)
        buf["seen"] = seen + m
        buf["size"] = min(seen + m, self.capacity)
        if slot_of_row:
            self.write(buf, fields, host_to_device(self.sources(slot_of_row, m), buf["y"].device))
        return len(slot_of_row)

    @staticmethod
    def fields(x: torch.Tensor, y: torch.Tensor, task: torch.Tensor | int, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The per-row tensors an offer keeps: {"x", "y", "task", extras...}, detached."""
        task = on_device(task, y.device, torch.long).expand(len(y))
        return {"x": x.detach(), "y": y.detach(), "task": task, **{k: v.detach() for k, v in extra.items()}}

    def places(self, seen: int, m: int, generator: torch.Generator) -> dict[int, int]:
        """Where the ``m`` rows of one offer go, the buffer having seen ``seen`` samples: {slot:
        row}, the last row drawn to a slot (Algorithm 4 row after row; ``policy``). Draws
        ``m`` float64 uniforms from ``generator``."""
        cap = self.capacity
        u = torch.rand(m, generator=generator, dtype=torch.float64)
        n = torch.arange(seen, seen + m, dtype=torch.float64)  # samples seen before each row
        if self.policy == "reservoir":  # j ~ U{0..n}; kept if j < B
            j = torch.minimum((u * (n + 1)).floor(), n).long().tolist()
        elif self.policy == "random":  # always kept, at a uniform slot
            j = torch.minimum((u * cap).floor(), torch.tensor(cap - 1.0)).long().tolist()
        else:  # sliding: the oldest row's slot
            j = [int(v) % cap for v in range(seen, seen + m)]
        slot_of_row: dict[int, int] = {}  # slot -> the last row written to it
        for i in range(m):
            s = seen + i if seen + i < cap else j[i]
            if s < cap:
                slot_of_row[s] = i
        return slot_of_row

    @staticmethod
    def sources(slot_of_row: dict[int, int], m: int) -> torch.Tensor:
        """How ``write`` writes an offer of ``m`` rows placed by ``slot_of_row`` (``places``),
        on the host: [2, m] long, per offered row r its slot and what it writes there, a row
        of (the buffer's slot 0, the offered rows): a kept row writes itself (1 + r); a row
        not kept repeats the first kept row's write (or, none kept, writes slot 0's own value
        back), so every write to a slot carries the same value."""
        first = next(iter(slot_of_row.items()), None)
        dst, src = torch.full((m,), first[0] if first else 0), torch.full((m,), 1 + first[1] if first else 0)
        for slot, row in slot_of_row.items():
            dst[row], src[row] = slot, 1 + row
        return torch.stack([dst, src])

    def write(self, buf: dict[str, Any], fields: dict[str, torch.Tensor], index: torch.Tensor) -> None:
        """An offer of ``fields`` (rows [m, ...] each) written into the buffer by ``index``
        (``sources``, on the buffer's device): one copy per offered row, of the same shape at
        every offer of m rows (a step captured in a CUDA graph replays it), the slots' values
        the same whichever of a slot's equal writes lands last (deterministic on a GPU)."""
        dst, src = index[0], index[1]
        for k, v in fields.items():
            b = buf[k]
            b.index_copy_(0, dst, torch.cat([b[:1], v.to(b.dtype)]).index_select(0, src))

    def rows_for(self, state: dict[str, Any], fields: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, Any]:
        """The buffer's dict in ``state`` for offers of ``fields`` (rows [m, ...] each): at the
        first offer, room for ``capacity`` rows of each field, zeros, shaped as they are; or
        for ``rows``, where fewer, the most rows the client will ever offer (``Replay.rows_ever``)
        [D]: a buffer larger than a client's data keeps every row it is offered, in slots
        0..seen-1, and no more room (``buffer_size: 10**12`` allocated 10**12 rows per client)."""
        buf = self._buf(state)
        if "y" not in buf:
            n = self.capacity if rows is None else min(self.capacity, rows)
            for k, v in fields.items():
                buf[k] = torch.zeros((n, *v.shape[1:]), dtype=v.dtype, device=v.device)
        stored = {k for k in buf if k not in _META}
        if stored != fields.keys():
            raise ValueError(f"replay buffer '{self.key}' keeps {sorted(stored)}, offered {sorted(fields)}")
        return buf

    # ------------------------------------------------------------------ the offer rule
    def offer_budget(self, ctx: ClientContext, train: TrainSpec) -> int:
        """Rows the client offers this round: its first epoch's rows (the engine's first
        epoch: ``train.epoch_rows``, every row or the full minibatches only with ``drop_last``) if this round's
        data reach past what the buffer was last offered, else 0. Marks the data as
        offered. Call once per client-round (``client_begin``)."""
        view = ctx.data
        if view is None or self.capacity == 0:
            return 0
        buf = self._buf(ctx.state)
        if view.stop <= int(buf["offered_upto"]):
            return 0
        buf["offered_upto"] = view.stop
        return train.epoch_rows(len(view), ctx.batch_size)

    def _buf(self, state: dict[str, Any]) -> dict[str, Any]:
        """The buffer's dict in ``state`` (created empty: its row tensors come with the
        first offer, shaped like the rows offered)."""
        return state.setdefault(self.key, {"size": 0, "seen": 0, "offered_upto": 0})


class ReplayPlan:
    """One client's replay in its local steps of one round, planned at its start [D]: the
    memory batches of every step (``draws`` per step, each ``m`` rows drawn as ``Reservoir.sample``
    draws them, in the order the steps would, from the client's ``sample_gen``) and the
    placement of every offer (``Reservoir.places``, from its ``offer_gen``), computed on the
    host from what the buffer will hold at each step: it has seen ``seen`` samples, and the
    round's first epoch offers its minibatches in order (``Replay.begin``'s ``to_offer``
    rows, in minibatches of ``ctx.batch_size``). The steps then read their rows from device
    tables at a count kept on the device (``shared.StepDraws``) and write each offer by one
    copy per offered row (``Reservoir.write``), with no host draw, copy or read: a step
    captured in a CUDA graph replays its own. The same draws, buffers and batches as
    sampling and offering step by step. ``key(k)``: what step k's kernels depend on (its
    memory rows, its offer's rows, whether it makes the buffer); ``finish`` writes the
    buffer's counters."""

    def __init__(
        self, buffer: Reservoir, ctx: ClientContext, s: SimpleNamespace, draws: int, m: int, device: torch.device
    ) -> None:
        self.buffer, self.draws, self.rows_ever = buffer, draws, s.rows_ever  # (Replay.begin)
        buf = ctx.state.get(buffer.key) or {}
        seen, cap, bs = int(buf.get("seen", 0)), buffer.capacity, ctx.batch_size
        self.offers = [min(bs, s.to_offer - i) for i in range(0, s.to_offer, bs)]  # rows offered at step k
        self.fresh = 0 if self.offers and "y" not in buf else -1  # the step whose offer makes the buffer
        self.rows: list[int] = []  # memory rows of step k (0: none, the buffer empty)
        # no batch holds more rows than the buffer (a memory batch size beyond it replays the
        # whole buffer at every step; 10**12 allocated that many columns)
        idx = torch.zeros(ctx.max_steps, draws, min(m, cap), dtype=torch.long)
        # each offer's, its first offers[k] columns (as wide as the widest offer: a batch_size
        # beyond every client's rows, full-batch training, allocated that many columns)
        sources = torch.zeros(len(self.offers), 2, max(self.offers, default=0), dtype=torch.long)
        for k in range(ctx.max_steps):
            size = min(seen, cap)
            self.rows.append(min(m, size) if draws else 0)
            for d in range(draws if size else 0):  # Reservoir.sample's draw, drawn at each step
                idx[k, d, : self.rows[k]] = torch.randperm(size, generator=s.sample_gen)[:m]
            if k < len(self.offers):
                sources[k, :, : self.offers[k]] = buffer.sources(buffer.places(seen, self.offers[k], s.offer_gen), self.offers[k])
                seen += self.offers[k]
        self.seen = seen
        self.memory = StepDraws(idx, device) if draws else None
        self.writes = StepDraws(sources, device) if self.offers else None

    def key(self, k: int) -> tuple[int, int, bool]:
        return (self.rows[k], self.offers[k] if k < len(self.offers) else 0, k == self.fresh)

    def batches(self, state: dict[str, Any], k: int) -> list[dict[str, torch.Tensor] | None]:
        """Step k's ``draws`` memory batches ({"x", "y", "task", extras...}, ``rows[k]`` rows
        each; None while the buffer is empty), read before the step's offer. Call once per
        step: the count moves on."""
        if self.memory is None:
            return []
        idx = self.memory.next()
        r = self.rows[k]
        if r == 0:
            return [None] * self.draws
        buf = state[self.buffer.key]
        return [{f: v.index_select(0, idx[d, :r]) for f, v in buf.items() if f not in _META} for d in range(self.draws)]

    def offer(self, state: dict[str, Any], k: int, x: torch.Tensor, y: torch.Tensor, task, **extra: torch.Tensor) -> None:
        """Step k's rows (x [n, ...], y [n], their ``task``, extras), offered where the plan
        places them (nothing after the first epoch)."""
        if k >= len(self.offers):
            return
        if len(y) != self.offers[k]:
            raise RuntimeError(f"replay plan: step {k} offers {len(y)} rows, planned {self.offers[k]}")
        fields = Reservoir.fields(x, y, task, extra)
        self.buffer.write(self.buffer.rows_for(state, fields, self.rows_ever), fields, self.writes.next()[:, : len(y)])

    def finish(self, state: dict[str, Any]) -> None:
        """The buffer's counters after the round's offers (call at the client's end)."""
        if self.offers:
            buf = state[self.buffer.key]
            buf["seen"], buf["size"] = self.seen, min(self.seen, self.buffer.capacity)


def buffer_bytes(capacity: int, shape: ClientShape, floats: int = 0) -> int:
    """[D] At most the bytes of one client's ``Reservoir`` of ``capacity`` rows (``rows_for``:
    never more rows than the client offers, ``shape.rows``): per row its input (as the model
    sees it), ``y`` and ``task`` (int64) and ``floats`` more float32 values (DER's logits)."""
    return min(capacity, shape.rows) * (shape.row_bytes + 4 * floats + 2 * 8)


def offer_generator(seed: int, rnd: int, cid: int, task: int) -> torch.Generator:
    """The reservoir's draws of client ``cid`` in round ``rnd`` on ``task``."""
    return torch.Generator().manual_seed(torch_seed(seed, rnd, cid, task, OFFER_STREAM))


def sample_generator(seed: int, rnd: int, cid: int, task: int, stream: int) -> torch.Generator:
    """A method's memory-batch draws (its own ``stream``) for client ``cid`` in round ``rnd``."""
    return torch.Generator().manual_seed(torch_seed(seed, rnd, cid, task, stream))


class Replay:
    """What A-GEM, DER and FedGP share on the client side: the buffer, the per-round offer
    budget and generators (in the method's scratch), each row's task and the logits of
    replayed rows (no task-IL masks: task-IL trains as class-IL, ``Scenario.masked``). Per-client values live in the method's scratch
    namespace passed in (``s``) and in ``ctx.state``; this object only holds constants."""

    def __init__(
        self, info: RunInfo, capacity: int, sample_stream: int, key: str = KEY, policy: str = "reservoir"
    ) -> None:
        self.info = info
        self.buffer = Reservoir(capacity, key, policy)
        self.sample_stream = sample_stream
        sc: Scenario | None = info.scenario
        # class -> task (split scenarios: each class is in one task), for rows' task ids
        self.task_of_class: torch.Tensor | None = None
        if sc is not None and sc.kind == "split":
            t = torch.full((info.num_classes,), -1, dtype=torch.long)
            for i, cls in enumerate(sc.task_classes):
                t[cls] = i
            self.task_of_class = t.to(info.device)

    def begin(self, ctx: ClientContext, s: SimpleNamespace) -> None:
        """Set up client ``ctx``'s round in the namespace ``s``: its offer budget and
        generators (keyed by seed, round, client, task)."""
        seed = self.info.seed
        s.to_offer = self.buffer.offer_budget(ctx, self.info.train)
        s.rows_ever = self.rows_ever(ctx)
        s.offer_gen = offer_generator(seed, ctx.round, ctx.cid, ctx.task)
        s.sample_gen = sample_generator(seed, ctx.round, ctx.cid, ctx.task, self.sample_stream)

    @staticmethod
    def rows_ever(ctx: ClientContext) -> int | None:
        """The most rows client ``ctx`` will ever offer (None: no data): each of its n
        positions once (every view starts where the data last offered ended:
        ``offer_budget``); under asynchronous boundaries, each window of S rows whose end
        passes the last one offered, so at most ceil(n / S) windows of S rows (the last window
        ends at the stream's end and overlaps the one before it; n rows where n <= S)."""
        view = ctx.data
        if view is None:
            return None
        n, window = view.data.size(ctx.cid), view.data.scenario.window
        if window is None or n == 0:
            return n
        s = min(window[0], n)
        return s * -(-n // s)

    def row_tasks(self, ctx: ClientContext, y: torch.Tensor) -> torch.Tensor | int:
        """The task of each training row: its class's task in split scenarios (a window of
        asynchronous boundaries may mix tasks), else the client's task."""
        return self.task_of_class[y] if self.task_of_class is not None else ctx.task

    def offer(self, ctx: ClientContext, s: SimpleNamespace, x, y, **extra) -> None:
        """Offer a trained minibatch if the round's first pass is not over."""
        if s.to_offer <= 0:
            return
        s.to_offer -= len(y)
        self.buffer.offer(ctx.state, x, y, s.offer_gen, self.row_tasks(ctx, y), s.rows_ever, **extra)

    def plan(self, ctx: ClientContext, s: SimpleNamespace, draws: int, m: int) -> None:
        """Set up client ``ctx``'s round (``begin``) and plan its replay steps, ``draws``
        memory batches of ``m`` rows per step (``s.plan``: ``ReplayPlan``)."""
        self.begin(ctx, s)
        s.plan = ReplayPlan(self.buffer, ctx, s, draws, m, self.info.device)

    def step(self, ctx: ClientContext, s: SimpleNamespace, k: int, x, y, **extra) -> list[dict[str, torch.Tensor] | None]:
        """Client ``ctx``'s step k by its plan: its memory batches, then its rows (x, y,
        extras: its real rows of the step) offered."""
        mems = s.plan.batches(ctx.state, k)
        s.plan.offer(ctx.state, k, x, y, self.row_tasks(ctx, y), **extra)
        return mems

    @staticmethod
    def planned(terms: StepTerms, scratches: list[SimpleNamespace]) -> PlannedTerms:
        """A stack's step ``terms`` keyed by its clients' plans (``scratches``: theirs, in
        the stack's order, each with ``plan``): step k of clients lo..hi-1 by their
        ``ReplayPlan.key(k)``."""
        return PlannedTerms(terms, lambda k, lo, hi: tuple(s.plan.key(k) for s in scratches[lo:hi]))

    @staticmethod
    def has(mems: list[dict[str, torch.Tensor] | None], device: torch.device, dtype=torch.bool) -> torch.Tensor:
        """[len(mems)]: 1 where a client has a memory batch, filled on the device (no host copy)."""
        t = torch.zeros(len(mems), dtype=dtype, device=device)
        for j, m in enumerate(mems):
            if m is not None:
                t[j].fill_(1)
        return t

    def padded(
        self, mems: list[dict[str, torch.Tensor] | None], keys: tuple[str, ...] = ("x", "y", "task")
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
        """The buffer batches of a stack's clients (``mems``: ``sample``'s, None for a client
        without one, at least one not None) stacked [G, width, ...], zero rows after each
        client's real ones: (the tensors of ``keys``, a mask [G, width] of 1.0 on the real
        rows, each client's row count)."""
        rows = [0 if m is None else len(m["y"]) for m in mems]
        pad = {k: padded([None if m is None else m[k] for m in mems], rows) for k in keys}
        return pad, rows_mask(rows, pad["x"]), rows

    def task_counts(self, state: dict[str, Any]) -> list[int]:
        """The buffer's rows of each task of the stream (FedGP Fig. 4); [] without tasks."""
        sc = self.info.scenario
        tasks = int(getattr(sc, "tasks", 1)) if sc is not None else 1
        if tasks <= 1:
            return []
        rows = self.buffer.rows(state).get("task")
        if rows is None:
            return [0] * tasks
        return torch.bincount(rows.reshape(-1).long().cpu(), minlength=tasks)[:tasks].tolist()

