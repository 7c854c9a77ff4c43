"""The method hook API, in one place.

Eighteen hooks, named ``<where>_<what>``: ``model_`` on a freshly built model, ``server_`` on
the server (a ``ServerContext``), ``client_`` on one client (a ``ClientContext``), ``eval_``
in evaluation. A federated round, as the engine (``fedforget.engine``) and the local trainer
(``fedforget.trainers``) run it (once per run: ``model_init(model)`` on each freshly built
model, e.g. L2P's prompts; ``server_init(server)`` before round 1)::

    at a task's first round:  method.server_task_begin(server)        # server.task = t
    server.broadcast = method.server_broadcast(server)       # extra payload for clients
    for each sampled client k (same schedule for every method):
        model <- global weights; optimizer rebuilt at this round's lr
        method.client_begin(ctx)                             # start of local training
        for each epoch, for each minibatch (x, y):
            loss = method.client_step(ctx, x, y)             # fills .grad; default:
                 #   features, logits = model(x)
                 #   sum of method.client_loss(ctx, x, y, features, logits).values()
                 #   (the terms: "task" CE, then the method's own), .backward()
            method.client_grad(ctx)                          # per-step gradient transform
            optimizer.step()
        upload_k = method.client_end(ctx)                    # end of local training
    method.server_aggregate(server, uploads)                 # new server.global_params
                 # (default: FedAvg, weighted by n_k), then any server step after it
    (a task's last round: the task-end exchanges below)
    if ROUND_END in method.exchanges:                        # a second message per round
        for each client k that trained this round:           # (iCaRL's class means; with
                 # round_end_untrained every sampled client: FedGP's buffer gradients)
            reply_k = method.client_reply(ROUND_END, ctx)    # ctx.model = new global model
        method.server_collect(ROUND_END, server, {k: reply_k})   # before the next broadcast
                 # (an exchange in method.stacked_replies, on the stacked trainer: the
                 # clients' replies a stack at a time, method.client_replies(ROUND_END, ctxs, grads))
    metrics row += method.server_metrics(server, uploads)    # method diagnostics
    evaluation: method.eval_predict(server, model, x, task)  # scores; default the logits
                method.eval_counts(server, model, x, y, task)    # other accuracies

Tasks (the continual track; a one-task experiment is the case T = 1). The scenario
(``fedforget.data.scenario``, ``info.scenario``) maps each round to the server's task and
each (client, round) to the client's task (``ctx.task``)::

    after the task's last round (aggregated), if TASK_END in method.exchanges:
        for every client with data in task t:
            report_k = method.client_reply(TASK_END, ctx)    # ctx.model = the task's final
                                                             # global model, ctx.data its data
        method.server_collect(TASK_END, server, {k: report_k})   # e.g. GPM/FOT bases
        (AFTER_TASK: the same clients reply again on the new broadcast, then collect)

A method whose step is not one forward and backward of its loss, but still a function of
the step's own forward pass, states it once for a stack of clients in
``client_live_terms`` (``live_terms``): a loss of the step's logits or features (FedNTD, MOON), or a
perturbation eps for a second pass at w + eps whose task-loss gradient is the update
(FedSAM, FedSOL); its sequential ``client_step`` calls the same functions on a stack of one.

An extra exchange is one generic message round, declared by name in ``exchanges``
(``EXCHANGES`` below says when each runs); a method never needs a new hook pair for one.

Clients trained together (``fedforget.vectorized``, the stacked trainer) run FedAvg's local
step for all sampled clients at once. A method whose local-training change is a term added
to every step's loss, that depends only on the client's own weights and on values fixed for
the round (FedProx's proximal term, FedDyn's linear and quadratic terms, SCAFFOLD's
control-variate correction, FedCurv's penalty), states that term once, for a stack of
clients, in ``client_step_terms``: a client training alone is a stack of one (FedAvg's
default ``client_loss`` and ``client_grad`` apply it), the stacked trainer applies it to the
whole stack, and both take the loss term's gradient from autograd; ``client_begin`` then runs
once for every client, before the stacked pass (on the global weights), and the same context,
with what the steps left in its scratch, goes to its ``client_end`` after the client's trained
weights are loaded into the model's own parameter tensors in place (a scratch that holds those
tensors, FedProx's and FedDyn's, reads the trained values there). A method without terms whose
clients make their own upload gets a fresh context for ``client_end``, without ``client_begin``.

State, by lifetime (``fedforget.state.FedState`` holds and checkpoints the last two):

- a step: locals of ``client_step``;
- a client's round: ``ctx.scratch`` (``self.scratch(ctx)``, one namespace per method) and
  ``ctx.stats`` (diagnostics, averaged over the round's clients); never checkpointed;
- a round's message: ``server.broadcast`` (server -> clients) and ``Upload.extras``
  (client -> server); a ``Summed`` share in a message is read by the server only as the sum
  over the clients, which the trainers fold as the messages arrive (``SummedTotal``);
- the run: ``ctx.state`` (the client's own dict, e.g. SCAFFOLD's c_i) and ``server.state``
  (the server's, e.g. SCAFFOLD's c), both checkpointed. Nothing that must survive a resume
  lives on the method object (it is rebuilt at a resume).

A method is one small file: subclass ``FedAvg``, set ``name``, declare hyperparameters in a
``Params`` dataclass (typed fields, ``fedforget.methods.params``; ``check()`` only for rules
across fields) and override
only the hooks where it differs from FedAvg. Register it with ``@METHODS.register("name")``;
every module in this package is imported (and so registered) by ``methods/__init__.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..state import FedState, OnFed, to_device  # noqa: F401 (to_device: re-exported)
from ..utils import host_to_device

if TYPE_CHECKING:  # pragma: no cover
    from ..clientdata import TaskView
    from ..data import PublicSet
    from ..data.scenario import Scenario
    from ..models import Classifier
    from ..train_spec import TrainSpec

Params = dict[str, torch.Tensor]
# terms(lo, hi, stacked weights[, the step's minibatch: StepBatch, for a method that
# ``sees_step``]) -> (extra loss per client or None, gradient additions by name or None, the
# step's gradient map or None): FedAvg.client_step_terms. A map's None for a name: the
# optimizer skips that parameter this step, for every client of the stack; a ``Held``: for
# the clients it marks
GradMap = Callable[[Params], Params]
StepTerms = Callable[..., tuple[torch.Tensor | None, Params | None, GradMap | None]]
# grads(x, task, loss_of, at) -> {name: [G, ...]}: what a reply stated for a stack of clients
# (``client_replies``) differentiates: each client's own loss of its rows x[j] ([G, B, ...];
# ``task`` [G, B] each row's task, or None) at the global weights, in the model's training
# mode (keyed dropout: each client's reply key), ``loss_of(logits, lo)``: the losses [a] of
# clients lo..lo+a-1 from their logits [a, B, C]; its gradient in every trainable parameter
# (zeros for one outside its graph). ``at``: the positions of x's G clients among the
# contexts of ``client_replies``. ``grads_alone``: a client alone; ``vectorized.reply_grads``: a stack
ReplyGrads = Callable[
    [torch.Tensor, torch.Tensor | None, Callable[[torch.Tensor, int], torch.Tensor], Sequence[int]], Params
]


def grads_alone(model: Classifier) -> ReplyGrads:
    """``ReplyGrads`` of one client (a stack of one) on ``model``, which holds the global
    weights: its logits of x[0] in training mode, each row through its own task's head
    (``row_logits``), as [1, B, C]; the gradient of ``loss_of``'s one loss, each [1, ...]
    (the trainer has set the client's reply dropout key). BatchNorm's running statistics move in ``model`` as in any training pass (the trainer
    loads the global ones again before the next client)."""

    def grads(
        x: torch.Tensor, task: torch.Tensor | None, loss_of: Callable[[torch.Tensor, int], torch.Tensor],
        at: Sequence[int] = (0,),
    ) -> Params:  # fmt: skip
        model.train()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        logits = model.row_logits(x[0], None if task is None else task[0]).unsqueeze(0)
        (loss,) = loss_of(logits, 0)
        gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        return {n: (torch.zeros_like(p) if g is None else g.detach()).unsqueeze(0) for (n, p), g in zip(named, gs)}

    return grads


class PlannedTerms:
    """Step terms (``client_step_terms``'s function) whose work on the host differs from
    step to step by a plan made at the clients' start [D]: A-GEM's and DER's memory
    batches and buffer offers (``methods.replay.ReplayPlan``). Called as the function it
    wraps; ``key(k, lo, hi)``: what step k's kernels depend on for clients lo..hi-1 besides
    the step's own shape (each client's memory rows, offers), by which the stacked trainer
    keys the steps it captures in CUDA graphs: a replay runs none of this Python, so two
    steps of one key must run the same kernels on the same tensors."""

    def __init__(self, terms: StepTerms, key: Callable[[int, int, int], tuple]) -> None:
        self.terms, self.key = terms, key

    def __call__(self, *args: Any) -> tuple[torch.Tensor | None, Params | None, GradMap | None]:
        return self.terms(*args)

    @staticmethod
    def like(base: StepTerms | None, terms: StepTerms) -> StepTerms:
        """``terms`` (a plug-in's, which call ``base``'s at each step) keyed as ``base`` is."""
        return PlannedTerms(terms, base.key) if isinstance(base, PlannedTerms) else terms


class Held(NamedTuple):
    """A gradient map's value for a parameter that some clients of the stack hold this step:
    the stack's gradients ``grad`` [G, ...] and ``held`` (bool [G]); the optimizer skips the
    held clients' parameter (no decay, no momentum), as torch.optim.SGD skips a None grad."""

    grad: torch.Tensor
    held: torch.Tensor

class StepBatch(NamedTuple):
    """The step's minibatch, for the step terms of a method that ``sees_step`` (A-GEM's
    replay: its memory batches, its buffer's offers), for the clients lo..hi-1 of the stack
    (a client alone: a stack of one). ``x`` [G, w, ...] the inputs as the model saw them
    (augmented where the dataset is), ``y`` [G, w], ``rows`` each client's real rows (a
    prefix of its w; padding follows), ``logits`` [G, w, C] the step's training forward on
    them, detached (DER keeps them). ``forward(w, x, task, rows=None)``: logits [G, m, C]
    of the stack's weights ``w`` (the terms' own argument) on inputs [G, m, ...], each row
    scored by its own task's head where heads are per task (``task`` [G, m]; the model's
    training mode: each client's BatchNorm statistics see its first ``rows[j]`` rows, its
    real ones, and only those); ``grad(loss, w)``: the gradient {name: [G,
    ...]} of a loss (the sum of the clients' own, each a function of its weights alone)
    in the weights ``w``, zeros for a parameter outside its graph."""

    x: torch.Tensor
    y: torch.Tensor
    rows: list[int] | None
    logits: torch.Tensor
    forward: Callable[..., torch.Tensor]
    grad: Callable[[torch.Tensor, Params], Params]
    # for a method's live terms (``client_live_terms``): each client's task loss [G] on the
    # step's rows (its cross-entropy: the mean over its real rows, its logit mask applied),
    # ``logits`` (the model's, unmasked) and ``features`` [G, w, F] (the body's output) with
    # it, still in the step's graph: differentiable in the stack's weights ``w`` (``grad``
    # keeps the graph, so the trainer's own backward follows); ``features_of(w, x)``: the
    # body features [G, m, F] of other stacked weights ``w`` on inputs [G, m, ...], without
    # dropout (as a frozen model in eval mode: MOON's previous models); ``logits_of(w, x)``
    # likewise the logits [G, m, C], by the kernels of the step's own forward, so that at the
    # step's own weights they are its logits bit for bit where no dropout is active (FedSOL's
    # frozen global model: its KL gradient is then exactly 0 at w = w_g, as on a client
    # alone, whose frozen copy runs the same module). None for step terms
    loss: torch.Tensor | None = None
    features: torch.Tensor | None = None
    features_of: Callable[[Params, torch.Tensor], torch.Tensor] | None = None
    mask: torch.Tensor | None = None  # [G, w] float, 1 on real rows: ``row_mask`` without
    #   ``rows`` (the batched live step leaves ``rows`` None, but for a method that declares
    #   ``step_rows``: no host read per step)
    logits_of: Callable[[Params, torch.Tensor], torch.Tensor] | None = None
    # the step's representations of several depths where the body has stages (the ResNets:
    # ``Classifier.forward_levels``), each [G, w, d_l], shallow to deep, in the step's graph;
    # None: one level, ``features`` (FedRCL's multi-level terms)
    levels: list[torch.Tensor] | None = None
    # the step's index in the round's local steps, on the host (every client of a stack takes
    # its k-th step together): a plan made at the clients' start is read by it (PlannedTerms)
    k: int | None = None
    # ``features_logits(w, x, rows=None)``: (body features [G, m, F], logits of every class
    # [G, m, C], each by its newest head: ``TaskHeads.combined``) of the stack's weights ``w`` on
    # inputs [G, m, ...], in training mode as ``forward`` (each client's BatchNorm statistics
    # see its first ``rows[j]`` rows): TARGET's and LANDER's synthetic rows
    features_logits: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def row_mask(self) -> torch.Tensor:
        """[G, w] float: 1 on each client's real rows, 0 on its padding."""
        if self.mask is not None:
            return self.mask
        cols = torch.arange(self.x.shape[1], device=self.x.device)
        return (cols < host_to_device(torch.tensor(self.rows), self.x.device)[:, None]).float()


class LiveStep(NamedTuple):
    """What a method's live terms (``FedAvg.client_live_terms``) return for one step of
    clients lo..hi-1: ``loss`` [hi - lo], an extra loss of the step's own forward pass (a
    function of ``StepBatch.logits``: FedNTD's distillation), added to the task loss before
    the step's one backward (and to the logged loss; a value without a graph is logged
    only); ``eps`` {name: [hi - lo, ...]}, a perturbation: the update gradient is then the
    task loss's at w + eps, by a second pass (SAM-style: FedSAM, FedSOL), taken from w;
    ``gmap``, a map of the step's gradients {name: [hi - lo, ...]} applied after them
    (FedSOL's projection, Eq. 3); ``done(grads, losses)``, called with the step's final
    gradients and the second pass's task losses [hi - lo] (None without one), for
    diagnostics; ``has`` (bool [hi - lo]), the clients ``loss`` is a term of (None: all;
    the others' loss is 0, as where a client alone adds no term: MOON's first round). Each
    None where unused."""

    loss: torch.Tensor | None = None
    eps: Params | None = None
    gmap: Callable[[Params], Params] | None = None
    done: Callable[[Params, torch.Tensor | None], None] | None = None
    has: torch.Tensor | None = None
    # [hi - lo]: the step's whole loss instead of the task loss plus ``loss``, a function of the
    # task loss (LANDER weighs it against its synthetic batch's terms); differentiated and logged
    total: torch.Tensor | None = None


# live(lo, hi, stacked weights, the step's StepBatch with live logits and loss) -> LiveStep
LiveTerms = Callable[[int, int, Params, StepBatch], LiveStep]


class JoinedLive:
    """Live terms (``client_live_terms``'s function) of a step that joins rows of the method's
    own to each client's minibatch, in the same forward pass (iCaRL's exemplars): ``rows(lo,
    hi, k)`` gives, for each client lo..hi-1 of the stack at its local step k, (x, y) of its
    rows, or None. The stacked trainer puts them after the client's real rows (its BatchNorm
    statistics see both, as the joined batch of a client alone), and the live terms get the
    joined batch (``StepBatch.x``, ``y``, ``logits``, ``mask``; the joined rows' logit mask
    allows every class: the method's own loss, ``LiveStep.total``, scores them). Called as
    the function it wraps. ``replaces``: a client's rows, where the method gives any, take the
    place of its minibatch's (CFeD's reviewers: surrogate rows instead of task rows); ``rows(lo,
    hi, k, counts)`` then also gets the number of minibatch rows each client has at step k."""

    def __init__(self, live: LiveTerms, rows: Callable[..., list], replaces: bool = False) -> None:
        self.live, self.rows, self.replaces = live, rows, replaces

    def __call__(self, *args: Any) -> LiveStep:
        return self.live(*args)


# The extra exchanges a method may declare (``FedAvg.exchanges``): one more message round
# beside the upload, a client pass (``reply(exchange, ctx)``) then a server step
# (``collect(exchange, server, replies)``). When each runs, and who replies on what:
TASK_END = "task_end"  # after a task's last round: every client with data in the task, on
#   the task's final global weights and its data of the task (asynchronous boundaries: a
#   client that moves on replies then, on the weights it had); then collect, once per task
AFTER_TASK = "after_task"  # after task_end's collect: the clients that replied to it, on the
#   same weights and data, with the broadcast as task_end left the server (a second task-end
#   message that needs what the server aggregated from the first: FedProTIP's references)
ROUND_END = "round_end"  # after each round's aggregation (and task end): the clients that
#   trained in it, on the NEW global weights and their data of the round (iCaRL's class
#   means); with ``round_end_untrained``, also the sampled clients that did not train (no rows
#   in the round), on an empty view of their round's task (FedGP's buffer gradients)
EXCHANGES = (TASK_END, AFTER_TASK, ROUND_END)

# the names of FedAvg's loss terms (``FedAvg.client_loss``)
TASK = "task"  # cross-entropy on the minibatch's labels
STEP_TERMS = "step_terms"  # the loss part of ``client_step_terms``


@dataclass
class ClientContext:
    """What a method sees of one client during its local training in one round."""

    cid: int
    round: int
    model: Classifier
    optimizer: torch.optim.Optimizer
    global_params: Params
    broadcast: dict[str, Any]
    state: dict[str, Any]
    n_samples: int
    lr: float
    local_epochs: int
    batch_size: int
    steps: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # diagnostics, averaged per round
    # the methods' working values for this client in this round (parameter pairs, sums for
    # diagnostics, ...), one namespace per method (FedAvg.scratch; a plug-in and its base
    # each have their own): set in client_begin, read by the step hooks; never kept across
    # rounds nor checkpointed (that is ``state``). A method object is shared by all clients,
    # so per-client values live here, not on it.
    scratch: dict[str, SimpleNamespace] = field(default_factory=dict)
    task: int = 0  # the client's current task (fedforget.data.scenario)
    # the client's training data of its current task (a ``TaskView``: len(), ``batch(pos)``,
    # ``sample(m, generator)``, ``all()``), reachable in every hook, the task-end reply included
    data: TaskView | None = None
    # the trainer's minibatches of local epoch e, (x, y) in its order, rows and
    # augmentation: for a method that needs them after a stacked pass, where no step hook ran
    # (FedGP's buffer offers); None outside a trainer
    minibatches: Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # at most this many minibatches per local epoch, set in client_begin (TARGET's code rule:
    # an epoch stops when its synthetic loader runs out); None: every minibatch. The stacked
    # trainer reads it where it calls client_begin before its pass: for a method with step or
    # live terms (tests/methods/test_protocol.py checks that a method setting it has them)
    epoch_steps: int | None = None
    # frozen copies of the client model that a method reloads for each client instead of
    # building one per client (the global or previous model: ``frozen_model``), owned
    # by the trainer, one set per model it trains on, so that clients trained at once on their
    # own model copies (``train.concurrent_clients``) never share one
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    # a frozen encoder's tensors that still hold exactly what the trainer loaded into them,
    # each mapped to the tensor it was loaded from (the global ones), read when called: an
    # upload shares those instead of copying them [D]; None outside a trainer
    as_loaded: Callable[[], Params] | None = None

    @property
    def max_steps(self) -> int:
        """The most local steps the client can take this round: its epochs of full and
        partial minibatches (at least one; a method that keeps one value per step)."""
        return self.local_epochs * max(-(-self.n_samples // self.batch_size), 1)

    def augment_rows(self, x: torch.Tensor, rows: torch.Tensor, stream: int, step: int | None = None) -> torch.Tensor:
        """Rows ``x`` [B, C, H, W] that a method replays in this local step from its own
        store (exemplars: model inputs), augmented as the step's private rows are (the
        dataset's ``augment``, ``fedforget.inputs.InputPipeline.replay_inputs``), keyed by
        (run seed, the method's ``stream``, round, client, this step ``steps`` (``step``: the
        stacked trainer's ``StepBatch.k``), each row's index ``rows`` in the store): a new
        crop per step, the same after a resume. ``x`` itself (the same object) where the
        dataset has no augmentation, or outside a run."""
        inputs = getattr(getattr(self.data, "data", None), "inputs", None)
        if inputs is None:
            return x
        return inputs.replay_inputs(x, rows, stream, self.round, self.cid, self.steps if step is None else step)


@dataclass
class Upload:
    """What a client sends back: its local weights, sample count, step count and extras."""

    cid: int
    n_samples: int
    params: Params
    steps: int
    extras: dict[str, Any] = field(default_factory=dict)


class Summed:
    """[D] A client's share of tensors the server reads only as their sum over the clients
    (secure aggregation: FOT's and FedProTIP's sketches), put anywhere in a message (an upload's extras, a
    reply, or a dict inside one): ``parts``, named float tensors."""

    def __init__(self, parts: dict[str, torch.Tensor]) -> None:
        self.parts = parts


class SummedTotal:
    """The sum of the shares of one place in an exchange's messages, in the clients' order:
    each part's float64 sum begun at zero and added share by share (the same bits whoever adds,
    a trainer folding as the messages arrive or the server at the end: ``summed_total``).

    Folded (``add``), it holds the first share as it is (float32: one client costs what its
    message does) and, from the second on, each part's float64 sum, adding a share into it part
    by part and dropping the share's part as it goes: a round then holds the sum (twice a
    share) and the share at hand, not a share per client. Shares read later are held one a
    client until summed: the task reports waiting for an asynchronous task end, and the
    replies of clients on lanes (``train.concurrent_clients``), folded in order once the
    lanes are done [D: a fold as each lane ends would add on one lane's CUDA stream what
    another wrote]. ``clients``: the shares in it."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}  # part -> float64 sum (two shares added or more)
        self.held: list[Summed] = []  # shares not yet added (folded: one at most)
        self.parts: list[str] = []  # the parts' names, the first share's
        self.clients = 0

    def names(self) -> list[str]:
        return list(self.parts)

    def shape(self, name: str) -> torch.Size:
        return (self.sums[name] if self.sums else self.held[0].parts[name]).shape

    def add(self, share: Summed, consume: bool = True) -> None:
        """Add ``share``; with ``consume``, once two are in, every held share is added to the
        float64 sums and its parts removed from it (their memory freed: a folded share is not
        read again)."""
        if not self.clients:
            self.parts = list(share.parts)
        elif sorted(share.parts) != sorted(self.parts):
            raise ValueError(f"summed parts differ: {sorted(share.parts)} against {sorted(self.parts)}")
        self.held.append(share)
        self.clients += 1
        if not consume or (not self.sums and len(self.held) < 2):
            return
        for name in self.names():
            self.sums[name] = self.with_held(name, consume=True)
        self.held = []

    def part(self, name: str) -> torch.Tensor:
        """Part ``name``'s float64 sum (one part at a time where shares are held: the server
        reads a sum of unfolded shares part by part)."""
        return self.sums[name] if self.sums else self.with_held(name, consume=False)

    def with_held(self, name: str, consume: bool) -> torch.Tensor:
        """Part ``name``'s sum (begun at zero) plus the held shares' parts, in order; with
        ``consume``, each share's part removed as it is added."""
        acc = self.sums.get(name)
        if acc is None:
            first = self.held[0].parts[name]
            acc = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
        for held in self.held:
            acc += (held.parts.pop(name) if consume else held.parts[name]).to(acc.device)
        return acc


def fold_summed(totals: dict[tuple, SummedTotal], message: Any, at: tuple = ()) -> None:
    """Add the ``Summed`` shares in ``message`` (a dict, nested dicts searched; an ``Upload``:
    its extras) to ``totals``, one ``SummedTotal`` per place in the message, and put the total
    in the share's place (folding a message twice adds nothing)."""
    if isinstance(message, Upload):
        message = message.extras
    if not isinstance(message, dict):
        return
    for k, v in message.items():
        if isinstance(v, dict):
            fold_summed(totals, v, (*at, k))
        elif isinstance(v, Summed):
            total = totals.setdefault((*at, k), SummedTotal())
            total.add(v)
            message[k] = total


def summed_total(values: Iterable[Summed | SummedTotal]) -> SummedTotal:
    """The sum of ``values``, one place's shares across an exchange's messages in the clients'
    order: the trainer's total where it folded them (every value is that one total), else the
    shares summed here, part by part as they are read (``SummedTotal.part``)."""
    values = list(values)
    distinct = list({id(v): v for v in values}.values())
    if len(distinct) == 1 and isinstance(distinct[0], SummedTotal):
        if distinct[0].clients != len(values):  # the server reads every client it folded
            raise ValueError(f"a total of {distinct[0].clients} clients' shares read as {len(values)} clients'")
        return distinct[0]
    if not distinct or any(isinstance(v, SummedTotal) for v in distinct):
        raise ValueError(f"{len(distinct)} values to sum: shares, or one folded total, expected")
    total = SummedTotal()
    for v in distinct:
        total.add(v, consume=False)
    return total


class ServerContext:
    """What a method sees of the server: the global weights, its own server state, the
    round and the server's task (all four held by the run's ``FedState``, their one home,
    so that what a method writes here is what is checkpointed), this round's ``server_broadcast``,
    a server-side ``model`` for steps that need one (distillation), the device and the
    public set. Built on the engine's ``FedState``, or on a fresh one (a method's test)."""

    def __init__(
        self,
        round: int,
        global_params: Params,
        model: Classifier,
        device: torch.device,
        public: PublicSet | None,
        state: dict[str, Any] | None = None,
        broadcast: dict[str, Any] | None = None,
        task: int = 0,
        fed: FedState | None = None,
    ) -> None:
        if fed is None:
            fed = FedState(global_params, {} if state is None else state, round=round, task=task, device=device)
        self.fed = fed
        self.model = model
        self.device = device
        self.public = public
        self.broadcast: dict[str, Any] = {} if broadcast is None else broadcast
        # while the method aggregates a round, the parameters no client trained in it (other
        # tasks' heads): new global weights keep their current values, bit for bit [D]
        self.untrained: tuple[str, ...] = ()

    @property
    def global_params(self) -> Params:
        return self.fed.global_params

    @global_params.setter
    def global_params(self, value: Params) -> None:
        for name in self.untrained:
            value[name] = self.fed.global_params[name]
        self.fed.global_params = value

    state = OnFed("server")
    round = OnFed("round")
    task = OnFed("task")


@dataclass(frozen=True)
class RunInfo:
    """Facts about the run a method may need at construction."""

    device: torch.device
    num_classes: int
    seed: int
    num_clients: int  # K, all clients (not only those sampled in a round)
    train: TrainSpec  # rounds, local epochs, batch size, optimizer (lr, momentum, ...)
    scenario: Scenario | None = None  # the task stream (tasks, classes per task, setting)
    input_shape: tuple[int, ...] | None = None  # one input's shape (a generator's output: TARGET)
    class_names: tuple[str, ...] | None = None  # the dataset's class names (label texts: LANDER)
    # the per-channel (mean, std) by which stored images become model inputs (dataset
    # constants, no rows; TARGET's generator makes model inputs as the data's are), or None
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None = None


@dataclass(frozen=True)
class ClientShape:
    """[D] What a method's per-client state besides model copies is sized by, known before
    any data are loaded (``FedAvg.client_kept_bytes``): one model input's shape and the bytes
    of each of its values as the model sees it (4: uint8 images become float32; else the
    stored dtype's, 8 for int64 token ids), the classes, the most training rows one client
    can ever offer (the dataset's training rows; twice that under asynchronous windows,
    whose clipped last window offers again: ``replay.Replay.rows_ever``), and ``build``, which
    gives the model's layers (on the meta device: ``models.meta_model``; None where only a hub
    config knows them), called only by a method that reads ``model`` (GPM; iCaRL and SCR for
    their class reports' feature width): most keep nothing the model sizes, and building one
    may import a package (a ViT: torchvision)."""

    input_shape: tuple[int, ...]
    value_bytes: int
    num_classes: int
    rows: int
    build: Callable[[], nn.Module | None] = lambda: None

    @property
    def row_bytes(self) -> int:
        """The bytes of one model input."""
        return math.prod(self.input_shape) * self.value_bytes

    @property
    def model(self) -> nn.Module | None:
        return self.build()


@dataclass(frozen=True)
class NoParams:
    def check(self) -> None:
        """Raise ValueError naming the field, the value and what is allowed."""


def masked_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [..., C] with the classes outside ``mask`` (bool, broadcastable) set to
    -inf, so softmax and arg-max see only the allowed classes (their gradient is 0)."""
    return logits if mask is None else logits.masked_fill(~mask, float("-inf"))


def task_cross_entropy(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The loss on the minibatch's labels: cross-entropy over the classes the step may score
    (``mask``: ``FedAvg.task_mask``, each row's classes where a method scores fewer than
    every class; None: every class, task-IL included, which trains as class-IL)."""
    return F.cross_entropy(masked_logits(logits, mask), y)


def total_loss(terms: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of a ``client_loss``'s terms, in their order (the first term itself where it
    is the only one: no added zero)."""
    values = iter(terms.values())
    total = next(values)
    for v in values:
        total = total + v
    return total


def flatten_state(params: Params) -> torch.Tensor:
    """One flat tensor of the floating entries of a state dict, in its order."""
    return torch.cat(
        [v.detach().reshape(-1) for v in params.values() if torch.is_floating_point(v)]
    )


def client_sums(t: torch.Tensor) -> torch.Tensor:
    """[G]: each client's sum of a stacked tensor [G, ...] (a per-step term's per-client
    value; a scalar parameter's stack is [G]: SL-ViT's attention temperature)."""
    return t.reshape(t.shape[0], -1).sum(1)


def split_stacked(flats: Sequence[torch.Tensor], model: nn.Module) -> Params:
    """One flat vector per client over ``model``'s trainable parameters, in their order
    (SCAFFOLD's c_i, FedDyn's gradient) -> {name: [G, *shape]}, laid out like the batched
    engine's stacked weights."""
    shapes = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    parts = torch.stack(list(flats)).split([math.prod(s) for _, s in shapes], dim=1)
    return {n: part.reshape(len(flats), *s) for (n, s), part in zip(shapes, parts)}


def map_grads(named: Sequence[tuple[str, nn.Parameter]], gmap: GradMap) -> None:
    """A step's gradient map (``FedAvg.client_step_terms``) applied to one client's ``.grad``,
    in place, as a stack of one; a parameter the map gives None loses its gradient (the
    optimizer skips it: no decay, no momentum)."""
    with torch.no_grad():
        mapped = gmap({n: p.grad.unsqueeze(0) for n, p in named if p.grad is not None})
        for n, p in named:
            v = mapped.get(n, p.grad)
            if isinstance(v, Held):
                v = None if bool(v.held[0]) else v.grad
            if v is None:
                p.grad = None
            elif v is not p.grad and p.grad is not None:
                p.grad.copy_(v[0])


def frozen_model(ctx: ClientContext, name: str) -> nn.Module:
    """The frozen copy of ``ctx.model`` kept as ``name`` for reuse across clients
    (``frozen_copy``, built at its first use; the caller loads its weights), from the
    trainer's set for the model ``ctx`` trains on (``ClientContext.frozen``) [D]. With
    per-task heads it scores by the head ``ctx.model`` trains (FedNTD's and FedSOL's global
    logits; a method that scores another task's sets it after: iCaRL, TARGET). Its own head
    was the one active when it was copied, the first client's task: until 2026-12-06 FedNTD
    and FedSOL scored later tasks' rows by task 0's global head, and on lanes by whichever
    task a lane's first client had."""
    if name not in ctx.frozen:
        ctx.frozen[name] = frozen_copy(ctx.model)
    m = ctx.frozen[name]
    active = getattr(getattr(ctx.model, "head", None), "active", None)
    if active is not None:  # TaskHeads (not set_task: the copy's heads stay frozen)
        m.head.active = active
    return m


def frozen_copy(model: nn.Module) -> nn.Module:
    """A gradient-free eval-mode copy of ``model`` (weights reloaded by the caller): the
    frozen global (or previous) model of MOON, FedNTD and FedSOL (``frozen_model``)."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(False)
        p.grad = None
    return m.eval()


def weighted_average(states: Sequence[Params], weights: Sequence[float], skip: Sequence[str] = ()) -> Params:
    """sum_k w_k * theta_k with w normalised to sum 1; integer buffers (e.g. BatchNorm's
    num_batches_tracked) take the first client's value. Names in ``skip`` are left out of the
    result (``ServerContext.untrained``: the setter keeps their global values anyway)."""
    w = torch.tensor(weights, dtype=torch.float64)
    w = (w / w.sum()).tolist()
    out: Params = {}
    skip = set(skip)
    for name, first in states[0].items():
        if name in skip:
            continue
        if not torch.is_floating_point(first):
            out[name] = first.clone()
            continue
        acc = first * w[0]
        for s, wk in zip(states[1:], w[1:]):
            acc.add_(s[name], alpha=wk)
        out[name] = acc
    return out


def upload_weights(uploads: Sequence[Upload], mode: str) -> list[float]:
    """Each upload's weight in a server mean over the round's uploads, by ``mode``
    (``train.client_weights`` for the model average; FedDyn's and SCAFFOLD's ``weighting``):
    ``samples``, its client's training rows n_k [P McMahan et al.: the default]; ``uniform``,
    1 each: a plain mean [C: the FedGP code's ``FedAvg`` in models/Fed.py and the FedProTIP
    code's ``average_weights`` divide by the number of clients; FedGP's text calls its
    aggregation "the averaging of locally computed values"]."""
    return [u.n_samples if mode == "samples" else 1.0 for u in uploads]


class FedAvg:
    """FedAvg (McMahan et al., 2017): local SGD from the global weights, server average
    weighted by client sample counts (``train.client_weights: uniform``: a plain mean).
    Every other method overrides a few of these hooks."""

    name = "fedavg"
    Params: type = NoParams
    needs_public: bool = False  # the experiment must declare a public set
    public_labels: bool = False  # the method may read the public set's labels
    sees_all_tasks: bool = False  # clients train on all tasks' data at once (the joint upper bound)
    # the extra message rounds the method runs beside the upload (names from EXCHANGES): the
    # engine runs these and only these, each a client pass (``client_reply``) and a server step
    # (``server_collect``)
    exchanges: tuple[str, ...] = ()
    # ROUND_END: the reply does not depend on the round's new data, so a sampled client that
    # did not train (no rows in the round) replies too, on an empty view (FedGP's buffer
    # gradients, from rows kept in earlier rounds); False: only the clients that trained
    round_end_untrained: bool = False
    # the exchanges whose replies the method states for a stack of clients on the same global
    # weights in ``client_replies`` (FedGP's buffer gradients: one stacked pass): the stacked
    # trainer calls it a stack at a time; () : ``client_reply`` client by client everywhere
    stacked_replies: tuple[str, ...] = ()
    # what the trainers and the evaluator may assume, declared, never inferred from which
    # hooks a method writes (tests/methods/test_protocol.py checks each against the code):
    stacked: bool = True  # local training is FedAvg's SGD step plus ``client_step_terms``: the
    #   stacked trainer may run it (False: a hook changes the step itself; sequential only,
    #   several clients at once with train.concurrent_clients, each on its own model copy)
    step_terms: bool = False  # the method states per-step terms in ``client_step_terms``
    sees_step: bool = False  # its terms read the step's minibatch (a fourth argument: StepBatch)
    step_rows: bool = False  # its live terms read each client's real rows of the step as host
    #   numbers (``StepBatch.rows``; step terms that see the step always get them): the
    #   stacked trainer counts them from its host table, no device read, and keys the steps
    #   it captures by them (FedRCL cuts each client's rows out of the stack)
    own_upload: bool = False  # ``client_end`` differs from FedAvg's: run per client after a stacked pass
    live_terms: bool = False  # the method states terms of the step's own forward pass in
    #   ``client_live_terms`` (a loss of its logits, a second pass at perturbed weights): the
    #   stacked trainer runs it where it runs the model layer by layer (``stacked_forward``)
    live_heads: bool = False  # its live terms read the step's own forward (the active head's
    #   logits, as a client alone's step) and score other rows only through ``StepBatch.forward``
    #   or ``features_logits``, which route per-task heads: the stacked trainer runs it with
    #   per-task heads too (LANDER); False: refused there (``why_not_vectorized``)
    own_predict: bool = False  # ``eval_predict`` differs from the model's logits
    capturable_terms: bool = True  # its terms (step or live; FedAvg has none) may run inside a
    #   CUDA graph: in the step they read the step's tensors and tensors made before it, no
    #   host value that changes from step to step, no host read (tests/methods/test_graphs.py
    #   runs each under the tape, and checks that a method declaring False needs it)
    one_task_per_class: bool = False  # it maps each class to one task (a split's classes
    #   disjoint): refused on a split whose neighbouring tasks share classes (class_overlap)
    shared_projection: bool = False  # its step terms are one map of the step's gradient, fixed
    #   by the round's broadcast, the same for every client (FedProTIP's projection): the
    #   engine's projection_geometry diagnostic applies it to whole-task gradients
    # float32 copies of the model each client keeps in its state across rounds (SCAFFOLD's c_i,
    # FedDyn's h_i, MOON's previous model, FedCurv's u, v and last weights), in host memory for
    # every client that has trained: the engine refuses before round 1 a run whose clients'
    # copies cannot fit there (``Simulation.check_client_state_fits``); a plug-in keeps its
    # base's (``client_copies``); tests/methods/test_resume_all_methods.py measures them
    client_model_copies: int = 0
    stacks_with_base: bool = False  # a plug-in (``plugin.OverBase``) whose own change is in its
    #   ``client_step_terms``, over its base's: it trains stacked wherever its base does (FedGP)
    # the classes the task loss scores for a row of each label, bool [C, C] (row = label),
    # where no task-incremental mask applies (``task_mask``; TARGET's ``ce: task``: the
    # classes of the label's task); None: every class. Data, read by both trainers
    label_classes: torch.Tensor | None = None

    def __init__(self, params: Any, info: RunInfo) -> None:
        self.check_train(info.train, params)
        self.p = params
        self.info = info

    @classmethod
    def check_train(cls, train: TrainSpec, params: Any = None) -> None:
        """Reject train settings the method is not defined for (raise FedForgetError);
        called at config validation, before any job, and again at construction, with the
        method's validated ``Params``."""

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        """Reject task streams the method is not defined for (raise FedForgetError naming
        the scenario key): ``scenario`` is a dataset's resolved scenario block
        (``fedforget.data.scenario``; None: one task). Called at config validation for every
        dataset of the experiment, before any job."""

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        """Reject models the method is not defined for (raise FedForgetError naming the
        model): ``model`` is a dataset's model name, ``options`` its options (SCR's image
        augmentation needs models of images; L2P's frozen ViT refuses ``freeze_stages``).
        Called at config validation for every dataset of the experiment, before any job."""

    @classmethod
    def client_copies(cls, params: Any = None) -> int:
        """``client_model_copies`` of the method configured with ``params`` (a plug-in:
        its base's and its own)."""
        return cls.client_model_copies

    @classmethod
    def client_kept_bytes(cls, params: Any, shape: ClientShape) -> int | None:
        """[D] At most how many bytes of tensors other than model copies one client keeps in
        ``ctx.state`` across rounds (a replay buffer, exemplars, bases), or the server keeps
        for it (a class report: iCaRL, SCR), at their fullest, for a client of ``shape``
        (``ClientShape``); None where only the model's hub config knows. 0 here: FedAvg keeps nothing. With ``client_copies``, the training job's
        resource ``client_state_mb`` (``parse.client_state_of``);
        tests/methods/test_resume_all_methods.py measures every method's state against it."""
        return 0

    @classmethod
    def trait(cls, name: str, params: Any = None) -> bool:
        """A class-level trait (``needs_public``, ``public_labels``, ``sees_all_tasks``,
        ``stacked``) of the method configured with ``params``: what the engine and config
        validation read (a plug-in has its base's too)."""
        return bool(getattr(cls, name))

    @classmethod
    def table_note(cls, params: dict[str, Any]) -> str:
        """Which paper-or-code variant ran, in words, for the tables' notes (``params``: the
        run's recorded hyperparameters, a dict): e.g. GPM's task-0 rank rule. '' where the
        method has no such switch (the default)."""
        return ""

    def model_init(self, model: nn.Module) -> None:
        """Change a freshly built model in place before training: add parameters (they
        become part of the global weights: aggregated, checkpointed), freeze a backbone
        (L2P's prompt pool on a frozen ViT). Called for the clients' and the server's model,
        right after the global RNG is seeded for initialisation, so both come out the same.
        Default: nothing."""

    # ---------------------------------------------------------------- server side
    def server_init(self, server: ServerContext) -> None:
        """Create per-run server state (server.state) before round 1."""

    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        """Extra payload sent to every sampled client this round (beside the weights)."""
        return {}

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        """The server's step on the round's uploads: new ``server.global_params`` (FedAvg:
        the average weighted by ``upload_weights``, n_k by default), then whatever follows from them (distillation on the
        new weights, FedDyn's h, SCAFFOLD's c). ``server.global_params`` holds the broadcast
        weights until the method writes the new ones; the parameters no client trained this
        round keep their broadcast values whatever is written (``ServerContext``)."""
        server.global_params = weighted_average(
            [u.params for u in uploads], upload_weights(uploads, self.info.train.client_weights), skip=server.untrained
        )

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        """Method diagnostics added to this round's metrics row (prefixed by the method)."""
        return {}

    def server_task_begin(self, server: ServerContext) -> None:
        """Start of task ``server.task`` (before its first round's broadcast)."""

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        """The server's step of the extra exchange ``exchange`` (one of the method's
        ``exchanges``; ``EXCHANGES`` says when each runs): ``replies`` maps each client that
        took part to what its ``client_reply`` returned (None left out). ``task_end`` runs once per
        task even when no client replied."""

    def eval_predict(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, task: int | None
    ) -> torch.Tensor:
        """Scores [B, C] of test inputs ``x`` (prediction = arg-max; the test loss is their
        cross-entropy); ``model`` holds the global weights, in eval mode. ``task``: the task
        the inputs come from where evaluation is task-aware (task-incremental), else None;
        the evaluator masks the classes outside that task afterwards. Default: the model's
        logits (with per-task heads, that task's head, or each class's newest head).
        iCaRL's nearest-mean classifier or FedProTIP's task routing replace it."""
        return model.logits(x, task)  # type: ignore[operator]

    def eval_counts(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: int
    ) -> dict[str, torch.Tensor]:
        """Other ways to score the test batch ``x`` (labels ``y``) of task ``task`` than
        ``eval_predict``'s: {column: number of its rows counted correct} (0-d tensors). The
        evaluator sums each over the task's batches and divides by the task's test rows: an
        extra column of tasks.csv (an accuracy in [0, 1]), and its mean over the tasks after
        the last one in runs.csv and continual.csv, as ACC. Default: none."""
        return {}

    # ---------------------------------------------------------------- client side
    def scratch(self, ctx: ClientContext) -> SimpleNamespace:
        """This method's working values for ``ctx``'s client in this round."""
        return ctx.scratch.setdefault(self.name, SimpleNamespace())

    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        """A client's message in the extra exchange ``exchange`` (one of the method's
        ``exchanges``; ``EXCHANGES`` says which clients reply, on which weights and data):
        what goes to ``server_collect`` (None: nothing)."""
        return None

    def client_replies(self, exchange: str, ctxs: Sequence[ClientContext], grads: ReplyGrads) -> list[Any]:
        """The replies (``client_reply``'s, in the order of ``ctxs``) of several clients in the
        exchange ``exchange``, for a method that declares it in ``stacked_replies``: every
        context on the same global weights (the trainer loaded them once; a reply must leave
        the model's weights alone), ``grads`` (``ReplyGrads``) takes the gradients of each
        client's own loss in one pass for the stack. A method writes its reply once, here,
        and its ``client_reply`` is this for one context with ``grads_alone(ctx.model)``.
        Default: ``client_reply`` for each."""
        return [self.client_reply(exchange, ctx) for ctx in ctxs]

    def client_begin(self, ctx: ClientContext) -> None:
        """Start of local training (ctx.model holds the global weights)."""

    def client_loss(
        self,
        ctx: ClientContext,
        x: torch.Tensor,
        y: torch.Tensor,
        features: torch.Tensor,
        logits: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The loss terms of one minibatch ``(x, y)`` given the model's forward pass on it
        (``features``, ``logits``): {name: scalar}, summed in order (``total_loss``) into
        what ``client_step`` differentiates. FedAvg: ``TASK`` (cross-entropy over the classes
        the step may score, ``task_cross_entropy``), then the loss part of the method's
        ``client_step_terms`` for this client alone (a stack of one). A method adds its own
        term after ``super()``'s (MOON's contrastive term) or replaces ``TASK`` (a different
        mask); a plug-in reads its base's terms apart (FedSOL)."""
        terms = {TASK: task_cross_entropy(logits, y, self.task_mask(y))}
        step = self._own_terms(ctx)
        if step is not None:
            w = {n: p.unsqueeze(0) for n, p in ctx.model.named_parameters() if p.requires_grad}
            sc = self.scratch(ctx)
            args = (self._step_alone(ctx, x, y, logits),) if self.sees_step else ()
            loss, sc.step_grads, sc.step_map = step(0, 1, w, *args)
            sc.step_done = True
            if loss is not None:
                terms[STEP_TERMS] = loss[0]
        return terms

    def task_mask(self, y: torch.Tensor) -> torch.Tensor | None:
        """The classes each row of labels ``y`` lets the task loss score: the rows'
        ``label_classes`` (TARGET's ``ce: task``), None without them (every class; task-IL
        trains as class-IL, ``Scenario.masked``). A helper, not a hook: the stacked trainer
        applies the same rule."""
        return None if self.label_classes is None else self.label_classes[y]

    def _step_alone(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> StepBatch:
        """The StepBatch of a client training alone: its model's own forward (per-task heads
        routed per row: ``Classifier.row_logits``) and the gradient in its parameters,
        which the stack-of-one weights of ``client_loss`` are views of."""
        model = ctx.model
        live = dict(model.named_parameters())

        def forward(w: Params, xm: torch.Tensor, task: torch.Tensor | None, rows: list[int] | None = None) -> torch.Tensor:
            return model.row_logits(xm[0], None if task is None else task[0]).unsqueeze(0)

        def features_logits(w: Params, xm: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            z = model.features(xm[0])
            return z.unsqueeze(0), model.head_logits(z).unsqueeze(0)

        def grad(loss: torch.Tensor, w: Params) -> Params:
            ps = [live[n] for n in w]
            gs = torch.autograd.grad(loss, ps, allow_unused=True)
            return {n: (torch.zeros_like(p) if g is None else g).unsqueeze(0) for n, p, g in zip(w, ps, gs)}

        return StepBatch(x.unsqueeze(0), y.unsqueeze(0), [len(y)], logits.detach().unsqueeze(0), forward, grad,
                         k=ctx.steps, features_logits=features_logits)  # fmt: skip

    def _own_terms(self, ctx: ClientContext) -> StepTerms | None:
        """This client's ``client_step_terms`` (built once per client and round, at its first
        step's loss; without autocast, as the stacked trainer builds a stack's: a projection's
        I - U U^T in bf16 moved a full basis's protected directions by 3e-3 [D])."""
        sc = self.scratch(ctx)
        if not hasattr(sc, "step_terms"):
            device = next(ctx.model.parameters()).device
            with torch.autocast(device.type, enabled=False):
                sc.step_terms = self.client_step_terms([ctx])
        return sc.step_terms

    def batch_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The forward pass on ``x`` and the sum of ``client_loss``'s terms: L_k(w) on one
        minibatch (SAM-style methods evaluate it twice per step). A helper, not a hook."""
        features, logits = ctx.model.forward_with_features(x)
        return total_loss(self.client_loss(ctx, x, y, features, logits))

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One local step's gradient: fill .grad for the minibatch and return the loss
        (the trainer zeroes the gradients before, then ``client_grad``, then the optimizer's
        step). FedAvg: ``batch_loss(...).backward()``. Overridden where a step is not one
        forward pass on the minibatch: SAM-style perturbations (two passes), replayed rows
        joined to the minibatch (iCaRL, GLFC), a prompted forward (L2P)."""
        loss = self.batch_loss(ctx, x, y)
        loss.backward()
        return loss

    def client_grad(self, ctx: ClientContext) -> None:
        """Per-step gradient transform, in place on p.grad (projection, ...). Default: the
        gradient part of the method's ``client_step_terms`` for this client (SCAFFOLD's
        control-variate correction) added to p.grad, then its gradient map (a stack of one)."""
        terms = self._own_terms(ctx)
        if terms is None:
            return
        sc = self.scratch(ctx)
        named = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
        grads, gmap = getattr(sc, "step_grads", None), getattr(sc, "step_map", None)
        if not getattr(sc, "step_done", False) and not self.sees_step:  # no client_loss call
            with torch.no_grad():  # this step (a step of the method's own): its terms now
                _, grads, gmap = terms(0, 1, {n: p.unsqueeze(0) for n, p in named})
        sc.step_grads = sc.step_map = None
        sc.step_done = False
        for n, p in named:
            if grads and n in grads:
                if p.grad is None:  # a parameter outside this step's loss graph
                    p.grad = grads[n][0].clone()
                else:
                    p.grad.add_(grads[n][0])
        if gmap is not None:
            map_grads(named, gmap)

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms | None:
        """A method's per-step terms, written once for a stack of clients ``ctxs`` (after
        their client_begin): a function ``terms(lo, hi, w)`` of the stacked trainable weights
        ``w[name]`` [hi - lo, ...] of clients ``ctxs[lo:hi]`` at one local step that returns
        (their extra loss values [hi - lo], differentiable in w, or None; gradient additions
        that are not the gradient of a loss, {name: [hi - lo, ...]}, or None; the step's
        gradient map, a function of their whole gradients {name: [hi - lo, ...]} (the loss
        term's and the additions included) returning new ones, applied last, or None: FedGP's
        projection against g_ref). Both engines use this one
        definition: a client alone is a stack of one (the default ``client_loss`` and
        ``client_grad``), the batched engine takes the whole stack; the loss's gradient
        comes from autograd in both. Terms that depend only on the client's own weights and
        values fixed for the round (FedProx, FedDyn, SCAFFOLD, FedCurv), or a map of the
        step's gradient by values fixed for the round (FedGP). None (FedAvg): no terms."""
        return None

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms | None:
        """A method's terms of the step's own forward pass, written once for a stack of
        clients ``ctxs`` (after their client_begin), for a method that declares
        ``live_terms``: a function ``live(lo, hi, w, step)`` of the stacked weights ``w``
        [hi - lo, ...] of clients ``ctxs[lo:hi]`` and the step's ``StepBatch``, whose
        ``logits`` and ``loss`` (each client's task loss) are still differentiable in ``w``,
        returning a ``LiveStep``: an extra loss of those logits (FedNTD), or a perturbation
        eps for a second pass whose task-loss gradient at w + eps is the update (FedSAM,
        FedSOL; when eps touches only the head, the second pass reuses the first pass's
        body features, which are unchanged), and a callback for diagnostics. The stacked
        trainer runs it; a method's sequential ``client_step`` calls the same function on
        a stack of one where it can. None: no terms this round (e.g. rho = 0)."""
        return None

    def client_end(self, ctx: ClientContext) -> Upload:
        """End of local training: what the client uploads (a copy of each of the model's
        tensors, but the very tensor it was loaded from where it still holds exactly that:
        ``ClientContext.as_loaded``; no method writes into an upload)."""
        same = {} if ctx.as_loaded is None else ctx.as_loaded()
        params = {k: same[k] if k in same else v.detach().clone() for k, v in ctx.model.state_dict().items()}
        return Upload(ctx.cid, ctx.n_samples, params, ctx.steps)
