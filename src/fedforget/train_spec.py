"""The training settings of a run (``train:`` in a config): local training, rounds,
evaluation and where it runs. A typed, frozen object built once by ``fedforget.config``; it
sits below the methods (they read it to check what they are defined for) and imports
nothing of the package."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)


# each optimizer's fields beside name and lr (make_optimizer): another's would do nothing
OPTIMIZER_FIELDS = {"sgd": ("momentum", "weight_decay"), "adam": ("betas", "weight_decay")}


def optimizer_block_problem(raw: dict | None, key: str) -> str | None:
    """What is wrong with a config's ``optimizer`` mapping ``raw`` that names its optimizer
    and sets a field that optimizer does not read (``{name: adam, momentum: 0.9}``), or None.
    A block without ``name`` merges over the experiment's (a method's ``train``) and is not
    judged alone."""
    if not raw or raw.get("name") not in OPTIMIZER_FIELDS:
        return None
    own = OPTIMIZER_FIELDS[raw["name"]]
    other = [k for k in raw if k not in ("name", "lr", *own)]
    if not other:
        return None
    return (f"{key}.{other[0]}: optimizer '{raw['name']}' does not read it, so it would do nothing; "
            f"allowed with '{raw['name']}': lr, {', '.join(own)}")


def client_threads(threads: int, lanes: int) -> int:
    """The intra-op threads each client trains on where ``lanes`` clients train at once on a
    process of ``threads`` (``train.concurrent_clients``): the threads shared out, at least
    one each [D]. CPU results depend on it (``checkpoint.check_client_threads``)."""
    return max(1, threads // lanes) if lanes > 1 else threads


@dataclass(frozen=True)
class TrainSpec:
    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 32
    sample_rate: float = 1.0
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    lr_decay: float = 1.0
    eval_every: int = 1
    drop_last: bool = False  # skip each epoch's trailing partial minibatch
    eval_local_models: bool = True
    eval_batch_size: int = 1024
    eval_order: str = "stored"  # stored | shuffled: each task's test rows in evaluation batches (rundata.EVAL_ORDER_STREAM)
    diagnostics: tuple[str, ...] = ()  # extra per-round analyses, see metrics.DIAGNOSTICS
    save_client_models: tuple[int, ...] = ()  # rounds whose local models are saved (snapshots/)
    checkpoint_every: int | str = "auto"  # n (rounds) | auto: when the run writes checkpoint.pt (checkpoint.CheckpointCadence)
    client_engine: str = "auto"  # auto | sequential | vectorized (fedforget.vectorized)
    max_parallel_clients: int = 128  # clients per batched group (memory bound)
    concurrent_clients: int = 1  # clients trained (sequential engine) or replying at once (LocalTrainer.at_once)
    device: str = "auto"
    threads: int = 0
    data_storage: str = "auto"  # auto | device | stream: where the training pool lives (fedforget.inputs)
    precision: str = "fp32"  # fp32 | bf16: the local steps' forward passes (LocalTrainer.autocast)
    client_weights: str = "samples"  # samples | uniform: each upload's weight in the model average (FedAvg.client_weights)
    log_every: int = 1  # rounds between progress lines when not on a terminal (fedforget.progress)
    phase_memory: bool = False  # run.json records the peak memory of each phase of a round (fedforget.memory)
    # set by Experiment.runs, not by users: why client_engine auto trains this job's clients
    # one after another, to pair it with a method of its experiment that cannot batch them
    engine_pairing: str = ""

    def epoch_rows(self, n: int, batch_size: int | None = None) -> int:
        """The rows of a local epoch over ``n`` rows that train, in minibatches of
        ``batch_size`` (default ``self.batch_size``; a method passes its client context's):
        all of them; with ``drop_last`` the full minibatches only, except that a client with
        fewer rows than one batch keeps them as its one batch, unless it has a single row,
        which is no batch (BatchNorm cannot train on one row: the client does not train) [D]."""
        bs = batch_size or self.batch_size
        if not self.drop_last:
            return n
        if n >= bs:
            return (n // bs) * bs
        return n if n > 1 else 0

    def epoch_steps(self, n: int, batch_size: int | None = None) -> int:
        """Local steps per epoch over ``n`` rows (at least 1): the minibatches of
        ``epoch_rows``."""
        bs = batch_size or self.batch_size
        return max(math.ceil(self.epoch_rows(n, bs) / bs), 1)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> TrainSpec:
        d = dict(d or {})
        opt = OptimizerSpec(**{**d.pop("optimizer", {})})
        for key in ("diagnostics", "save_client_models"):
            if key in d:
                d[key] = tuple(d[key])
        if isinstance(opt.betas, list):
            opt = OptimizerSpec(**{**asdict(opt), "betas": tuple(opt.betas)})
        return cls(optimizer=opt, **d)
