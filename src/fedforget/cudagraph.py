"""CUDA graphs of the batched engine's training step (issue 21): on a GPU, a step of the
batched engine (``fedforget.vectorized``) for a small model is a few microseconds of
arithmetic in each of some seventy kernels, and the GPU waits on the host launching them.
A CUDA graph records a step's kernels once and replays them with one launch.

[D] A step's kernels depend on its shape only: the number of clients still training
(``active``) and the widest of their minibatches (``width``), plus the optimizer's constants.
The first time a shape is met the step runs as it is (eagerly: that is also the warm-up a
capture needs, cuBLAS and cuDNN set up outside it); the next time it is captured, and from
then on replayed. A shape met once (a rare tail) never costs a capture. Replay runs the same
kernels on the same shapes as the eager step, so results are the same bits.

What the graphs read and write has to stay at one address. FedAvg's SGD steps: the stacked
weights, momentum, BatchNorm statistics and loss sums live here (``stack``) across rounds,
sized for the largest group seen, and their graphs are kept while the optimizer's constants
stay (``constants``). On a GPU their lr is one of those tensors too (``lr``), so a decaying lr
keeps them; where the lr is a Python number (a CPU; the tape's tests choose either), each
round's new lr drops them. The steps with a method's terms
(built for one group: its global weights, control variates, bases), Adam's or per-task
heads' read tensors of one group's local training: their graphs live for that call
(``scope``), and only shapes met at least three times there are captured. A step reads its
minibatch rows from a static index tensor that each replay's rows are copied into (and a
streamed pool's minibatch, read ahead, likewise). Everything else a step allocates comes
from one memory pool that all live graphs share (they run one after another on one stream;
what a step allocates and keeps, e.g. FedSOL's stacked global weights, lives until its call
ends); once every graph of a pool has gone, the next capture starts a new one.

Set FEDFORGET_CUDA_GRAPHS=0 to run every step eagerly (the same results, slower).

A CPU stand-in for tests [D]: FEDFORGET_CUDA_GRAPHS=tape captures and replays on a CPU too,
with ``Tape`` in place of ``torch.cuda.CUDAGraph``. A tape records the operators a captured
step runs, on the tensors it ran them on; its replay runs those operators again on the same
tensors, each result written into the tensor the capture made. So a replay reads what a CUDA
graph's replay reads, the tensors present at capture whatever Python names point at now,
and a step that a graph would replay wrongly (a per-step value read from a new tensor, a
Python number that changes between replays of one key) replays wrongly on a CPU too, where
the tests can see it. A step that reads a tensor on the host (``.item()``, a data-dependent
shape) or makes a tensor from host values cannot be captured: the tape raises, where CUDA's
capture fails or would replay stale host memory; so does a draw from an explicit generator
(the keyed draws use CPU generators: a graph would replay the capture's numbers).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GRAPHS_ENV = "FEDFORGET_CUDA_GRAPHS"  # 1 (default): on a GPU; 0: never; tape: on a CPU too (tests)


def graphs_enabled(device: torch.device) -> bool:
    flag = os.environ.get(GRAPHS_ENV, "1")
    return flag == "tape" or (device.type == "cuda" and flag != "0")


# operators whose result needs the tensor's values on the host: not capturable; on a GPU also
# bincount (its length: the largest value) and the factorizations that check their info codes
# on the host [D]
_HOST_READS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select",
                         "_unique2", "unique_dim", "unique_consecutive", "lift_fresh", "lift_fresh_copy",
                         "bincount", "_linalg_check_errors", "_linalg_eigh", "_linalg_svd", "linalg_lstsq"})  # fmt: skip


def _shape_from_values(func, args, kwargs) -> bool:
    """An operator whose output shape a GPU reads from the tensors' values (a synchronisation
    CUDA's capture refuses), where the dispatcher shows no host read: indexing with a boolean
    mask (its rows: the mask's count), ``repeat_interleave`` without ``output_size``."""
    name = func.overloadpacket.__name__
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return str(func) == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None


class Tape(TorchDispatchMode):
    """A captured step on a CPU (the module's docstring): ``with tape:`` records, ``replay()``
    runs the record again. Holds every tensor the step touched (a graph's memory pool)."""

    forbids_host_copies = True  # utils.host_to_device raises while a tape records

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self._saved: dict[str, Callable] = {}

    def __enter__(self):
        # reads that bypass the dispatcher (a CPU tensor's memory read directly) fail too, in
        # the recording thread (another, e.g. a streamed pool's reader, reads as ever)
        thread = threading.get_ident()
        for name in ("tolist", "numpy", "__array__"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _host_read(name, self._saved[name], thread))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _HOST_READS or _shape_from_values(func, args, kwargs):
            raise RuntimeError(f"{func} in a captured step: it needs tensor values on the host (not capturable)")
        if isinstance(kwargs.get("generator"), torch.Generator):  # the keyed draws: CPU generators
            raise RuntimeError(f"{func} draws from a host generator in a captured step (not capturable)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                _write(out, func(*args, **kwargs))


def _host_read(name: str, original: Callable, thread: int) -> Callable:
    def read(self, *args, **kwargs):
        if threading.get_ident() != thread:
            return original(self, *args, **kwargs)
        raise RuntimeError(f"Tensor.{name}() in a captured step: it needs tensor values on the host (not capturable)")

    return read


def _write(old, new) -> None:
    """A replayed operator's result ``new`` into the capture's ``old`` (the same memory: a
    view or an in-place operator's own output is left alone)."""
    if isinstance(old, torch.Tensor):
        same = old.data_ptr() == new.data_ptr() and old.shape == new.shape and old.stride() == new.stride()
        if not same:
            old.detach().copy_(new)
    elif isinstance(old, (list, tuple)):
        for o, n in zip(old, new, strict=True):
            _write(o, n)


class StepGraphs:
    """One Simulation's captured steps and the tensors they update in place."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.seen: set[Hashable] = set()
        self.pool = None
        self.pool_graphs: weakref.WeakSet = weakref.WeakSet()  # the live graphs of ``pool``
        self.tensors: dict[str, torch.Tensor] = {}
        self.layout: Hashable = None
        self.captures = 0  # for tests and benchmarks
        self.replays = 0
        self.scoped_captures = 0  # of them, in a scope
        self._constants: Hashable = None

    def stack(
        self,
        global_params: dict[str, torch.Tensor],
        names: Sequence[str],
        m: int,
        momentum: bool,
        buffers: Sequence[str] = (),
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, torch.Tensor, dict[str, torch.Tensor]]:
        """(weights, momentum or None, loss sums, buffers) for ``m`` clients, every client
        starting from ``global_params``: the persistent tensors' first ``m`` rows; ``buffers``:
        the names of the model's buffers (BatchNorm's running statistics, kept per client and
        updated in place by the captured steps). A larger group or another model reallocates
        them, and the graphs that point at the old ones go."""
        layout = tuple((n, tuple(global_params[n].shape), global_params[n].dtype) for n in (*names, *buffers))
        have = self.tensors.get("loss_sum")
        if self.layout != layout or have is None or len(have) < m:
            self.graphs.clear()
            self.seen.clear()
            self.layout = layout
            dev = global_params[names[0]].device
            self.tensors = {"loss_sum": torch.zeros(m, device=dev)}
            for n in names:
                g = global_params[n]
                self.tensors["p." + n] = torch.empty((m, *g.shape), dtype=g.dtype, device=dev)
                self.tensors["b." + n] = torch.empty((m, *g.shape), dtype=g.dtype, device=dev)
            for n in buffers:
                g = global_params[n]
                self.tensors["s." + n] = torch.empty((m, *g.shape), dtype=g.dtype, device=dev)
        params = {n: self.tensors["p." + n][:m] for n in names}
        for n in names:
            params[n].copy_(global_params[n].unsqueeze(0).expand_as(params[n]))
        stats = {n: self.tensors["s." + n][:m] for n in buffers}
        for n in buffers:
            stats[n].copy_(global_params[n].unsqueeze(0).expand_as(stats[n]))
        bufs = None
        if momentum:
            bufs = {n: self.tensors["b." + n][:m] for n in names}
            for b in bufs.values():
                b.zero_()
        loss_sum = self.tensors["loss_sum"][:m]
        loss_sum.zero_()
        return params, bufs, loss_sum, stats

    def dropout_inputs(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the clients' dropout keys, a step counter): persistent tensors that captured steps
        read (``fedforget.dropout``), ``keys`` copied in; the caller fills the counter with
        each step's number before running it. Called after ``stack``."""
        have = self.tensors.get("dropout_keys")
        if have is None or len(have) < len(keys):
            self.graphs.clear()  # graphs that read the old tensors go
            self.seen.clear()
            size = max(len(keys), len(self.tensors.get("loss_sum", keys)))
            self.tensors["dropout_keys"] = torch.zeros(size, dtype=torch.int64, device=keys.device)
            self.tensors["dropout_step"] = torch.zeros((), dtype=torch.int64, device=keys.device)
        static = self.tensors["dropout_keys"][: len(keys)]
        static.copy_(keys)
        return static, self.tensors["dropout_step"]

    def lr(self, value: float) -> torch.Tensor:
        """The lr that persistent steps read on the device (``vectorized.lr_on_device``), one
        tensor across rounds with this call's ``value`` written in: a decaying lr keeps the
        graphs [D]. Called after ``stack`` (a new stack makes it anew)."""
        have = self.tensors.get("lr")
        if have is None:
            weights = next(t for k, t in self.tensors.items() if k.startswith("p."))
            have = self.tensors["lr"] = torch.zeros((), dtype=weights.dtype, device=weights.device)
        return have.fill_(value)

    def constants(self, values: Hashable) -> bool:
        """The persistent graphs' optimizer constants this call (momentum, ..., and the lr
        where it is a Python number): when they differ from the last call's (a decaying lr
        on a CPU: every round), the graphs made for those go [D] (no graph could replay
        them, and kept they would pile up round after round); returns whether they did."""
        if values == self._constants:
            return False
        self._constants = values
        self.graphs.clear()
        return True

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Graphs captured inside live until the scope ends [D]: the steps of one group's local
        training whose kernels read that group's own tensors (a method's terms, built for the
        group: its global weights, control variates, bases; Adam's moments), which no later
        group has at the same addresses. The persistent graphs stay; ``seen`` too, so a shape
        met in an earlier group is captured at once (its warm-up is done)."""
        outer, self.graphs, before = self.graphs, {}, self.captures
        try:
            yield
        finally:
            self.graphs = outer  # the scope's graphs go (and with them what they point at)
            self.scoped_captures += self.captures - before

    def run(
        self, key: Hashable, idx: torch.Tensor, step: Callable[..., None], *inputs: torch.Tensor | None,
        shape: Hashable = None,
    ) -> None:  # fmt: skip
        """``step(idx, *inputs)``: eagerly the first time its ``shape`` (default ``key``) is met
        (the libraries' set-up for the shape, outside any capture), captured the first time
        ``key`` (the shape and the constants) is met after that, replayed after; each replay's ``idx`` and
        ``inputs`` (e.g. a streamed pool's minibatch, read ahead; None stays None) copied
        into the tensors the capture read. ``step`` must only update tensors of ``stack`` in
        place (or, in a ``scope``, tensors that outlive the scope) and must not synchronise
        with the host."""
        hit = self.graphs.get(key)
        shape = key if shape is None else shape
        if hit is None and shape not in self.seen:
            self.seen.add(shape)
            step(idx, *inputs)
            return
        if hit is None:
            static = (idx.clone(), *(None if t is None else t.clone() for t in inputs))
            if idx.device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                # [D] a pool whose graphs have all gone (a scope's, cleared ones) is not named
                # again: a tensor a step kept may hold it, and PyTorch refuses a capture into a
                # pool that no graph uses but that still exists (its use count 0); a new one
                pool = self.pool if len(self.pool_graphs) else None
                try:
                    # thread_local: a streamed pool's reader thread may pin, copy and allocate
                    # meanwhile, on the default stream (global mode would fail the capture for it)
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        step(*static)
                except RuntimeError as e:  # no silent fallback: the step may have changed host state
                    raise RuntimeError(
                        f"a training step could not be captured in a CUDA graph ({e}); "
                        f"{GRAPHS_ENV}=0 runs every step eagerly (the same results)"
                    ) from e
                if pool is None:
                    self.pool, self.pool_graphs = graph.pool(), weakref.WeakSet()
                self.pool_graphs.add(graph)
            else:  # FEDFORGET_CUDA_GRAPHS=tape
                graph = Tape()
                with graph:
                    step(*static)
            self.graphs[key] = hit = (graph, static)
            self.captures += 1
            if isinstance(graph, Tape):  # recording ran the step (CUDA's capture does not)
                return
        graph, static = hit
        for to, t in zip(static, (idx, *inputs), strict=True):
            if to is not None:
                to.copy_(t)
        graph.replay()
        self.replays += 1
