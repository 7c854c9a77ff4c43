"""FedGP: buffer-based gradient projection for continual federated learning (Dai, Chen,
Sohn, Alam, Balakrishnan, Banerjee, Himayat, Lee; papers/fedgp.md), a plug-in over any base
method (``OverBase``): ``{name: fedgp, params: {base: der, base_params: {...}}}``.

Each round, with the base method's training, server and state unchanged:

1. Client step [P Eq. 5, Alg. 2; C]: after the base method's own gradient terms (its
   ``client_step`` and ``client_grad``: DER's logit replay, A-GEM's own projection, FedProx's
   proximal gradient, ...), over one flat vector made of every parameter with a gradient
   [C], with the reference gradient g_ref received this round::

       if <g, g_ref> < 0:  g <- g - <g, g_ref> / (||g_ref||^2 + eps) * g_ref

   then the optimizer step. ``eps`` = 1e-12 [D] (the code divides by ||g_ref||^2 alone); a
   zero g_ref never conflicts, so it changes nothing and gives no NaN. No g_ref in round 1
   (or while no buffer has rows): the base method alone [C].
2. Buffer [P Alg. 2/4, C]: each client keeps ``buffer_size`` rows (default 200) of what it
   trained on, kept across rounds and tasks and checkpointed, each sample offered once per
   task on the client's first pass over it (``replay.py``: FedGP's code offers during the
   first epoch of a task's first round). Over a base that keeps a replay buffer (A-GEM, DER:
   FedGP's Alg. 5-6 use one buffer M^k) FedGP reads that buffer and offers nothing itself;
   otherwise it keeps its own.
3. After aggregation (the ROUND_END exchange) [P Alg. 1, 3; C ``GradER``]: every client
   sampled in the round whose buffer has rows computes its buffer gradient at the NEW global
   model, whether or not it trained in the round (``round_end_untrained``: the reply reads
   only the buffer, rows of earlier rounds; a client with no rows of the current task, whose
   buffer holds only old tasks, is exactly the anti-forgetting signal: "the server aggregates
   the local buffer gradients g_ref^k from client k in [K]" [P]; the code samples every
   client every round, so each has trained [C]), the mean cross-entropy on
   ``ref_batch_size`` (32) rows drawn uniformly
   without replacement from its buffer, in training mode [C]; replayed rows are scored over
   every class (task-IL trains as class-IL) and with their own task's head (per-task heads),
   as A-GEM's are. The server
   averages them (mean over the clients with a non-empty buffer [D]; the code sums, and the
   projection is invariant to that scale) into g_ref, fixed for the whole next round.

Ablations (Sec. 5.2), each a hyperparameter, defaults = FedGP:
- ``manipulation`` [P Table 7]: ``project`` (above); ``average``: g <- (g + g_ref) / 2;
  ``project_scale``: project, then rescale to ||g||; ``rotate``: g <- ||g|| * u / ||u||
  with u = g/||g|| + g_ref/||g_ref||, i.e. g turned half-way towards g_ref (the bisector)
  keeping its magnitude [D: the paper says only "rotate g towards g_ref while keeping the
  magnitude"; turning all the way would make g parallel to g_ref, and turning to 90 degrees
  is project_scale].
- ``apply`` [P Table 7]: ``conflict`` (angle > 90 degrees, FedGP) | ``always`` (whenever
  g_ref != 0).
- ``rate`` p [P Table 8]: a step that qualifies is manipulated with probability p, from a
  generator keyed (seed, round, client, task, 0x85), one draw per step; 1 = FedGP; 0 turns
  FedGP off (the base method bit for bit: buffers and g_ref are still kept).
- ``buffer_policy`` [P Table 9]: reservoir | random | sliding (``replay.Reservoir``); with a
  replay base, the base's buffer is reservoir.
- ``buffer_size`` [P Table 2]; over a replay base it is the base's ``buffer_size``.

Randomness: buffer batches for g_ref from (seed, round, client, task, 0x84); the buffer's
offers from the replay stream (``replay.offer_generator``).

Trainers: over a base whose local step is FedAvg's or stated in step terms (FedAvg, FedProx,
FedDyn, SCAFFOLD, FedCurv, GPM, FedProTIP(-t), ...; ``trait("stacked", params)``), FedGP
trains on the stacked trainer too [D]: its manipulation is the gradient map of ``client_step_terms`` (the same
``manipulate``, on each client of the stack: ``stacked=True``), the rate's draws come from
each client's own generator, one per step, and its own buffer is offered the first epoch's
minibatches in order at the client's end (``ctx.minibatches``: the rows, order and
augmentation its steps saw), so buffers, g_ref and results equal the sequential trainer's up
to float summation order (tests/methods/test_fedgp.py). A parameter the base holds (GPM's
biases, FedProTIP's early layers) is left out of the flat vector, as its None gradient leaves
it out of a client alone's; where only some clients of a stack hold it, those clients are
manipulated one by one. Over a base whose step terms see the step (A-GEM, DER) FedGP passes
the step on (``sees_step``). Over a base whose step is live terms (iCaRL, GLFC, LGA, LANDER:
its whole loss, exemplars joined; ``stacks_over_live``) the stacked step differentiates the
base's loss, then FedGP's gradient map follows, as its ``client_grad`` follows the base's
``client_step`` on a client alone (tests/methods/test_glfc.py: over GLFC and iCaRL within
1e-5). Over a base with a step of its own (FedSOL, L2P, CFeD, ...) the clients train one
after another. The round-end replies are written once for a stack (``client_replies``,
``stacked_replies``): on the stacked trainer a group of clients takes its g_ref^k in one pass
of each client's own copy of the global weights (``vectorized.reply_grads``; the clients
whose buffer batches have as many rows together), within 1e-5 of one after another, except
on a model that routes rows through per-task heads or runs a Hugging Face encoder
(``vectorized.stacked_replies_refused``: client by client there, as before). The reply's
dropout (``cnn_fedgp``'s) draws each client's keyed masks (``dropout.reply_key``), the same
in both trainers [D]: before 2026-12-04 it drew from torch's generator, so FedGP's results
on a dropout model changed once then.

Diagnostics (``fedgp_<key>``; the base's own come out as ``fedgp_<base>_<key>``):
``proj_share`` (share of local steps manipulated), ``cos_before`` (mean cos(g, g_ref) over
steps with a g_ref, before manipulation), ``buffer_size`` (rows in the client's buffer after
the round) and, in task streams, ``buffer_task<t>`` (its rows of task t: the per-task
composition of Fig. 4, which compares the buffer policies), means over the round's clients;
``ref_norm`` (||g_ref|| computed at the end of
the round, for the next) and ``ref_clients`` (clients that contributed to it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..utils import FedForgetError, torch_seed
from .base import (
    ROUND_END,
    ClientContext,
    ClientShape,
    Held,
    PlannedTerms,
    ReplyGrads,
    RunInfo,
    ServerContext,
    Upload,
    grads_alone,
)
from .params import choice, integer, make_params, mapping, number, one_of, text
from .plugin import OverBase
from .registry import METHODS
from .replay import POLICIES, Replay, buffer_bytes, sample_generator
from .shared import StepDraws, StepSums, each_client, flat_dot, per_client, project

REF_STREAM = 0x84  # keyed randomness of the buffer batch behind g_ref^k
RATE_STREAM = 0x85  # keyed randomness of the projection rate's draws
OWN_STREAM = 0x86  # FedGP's own buffer (its Replay's memory-batch stream, unused for training)
STATE_KEY = "fedgp_g_ref"  # server.state and broadcast key of g_ref
EPS = 1e-12
MANIPULATIONS = ("project", "average", "rotate", "project_scale")
APPLY = ("conflict", "always")
DEFAULT_BUFFER = 200  # [P, fedgp.md Sec. 5.1.1]


def base_buffer_size(base: str, base_params) -> int | None:
    """[D] The rows of the replay buffer ``base`` keeps itself (params with ``buffer_size``:
    A-GEM, DER, iCaRL, SCR, as ``base_params`` set it), which FedGP reads instead of keeping its
    own; None for a base that keeps none. The one rule of the params' check and of
    ``FedGP.own_buffer_size``."""
    return getattr(make_params(base, dict(base_params), "base_params"), "buffer_size", None)


@dataclass(frozen=True)
class FedGPParams:
    base: str = text("fedavg")  # the method FedGP runs over (FL = fedavg); any registered method but fedgp
    base_params: dict[str, Any] = mapping()  # its hyperparameters
    buffer_size: int | None = one_of(None, {"type": "null"}, {"type": "integer", "minimum": 1})  # None: the base's buffer if it keeps one, else 200; 0 rows would be the base alone [D]
    buffer_policy: str = choice("reservoir", POLICIES)  # reservoir | random | sliding (Table 9)
    ref_batch_size: int = integer(32, minimum=1)  # buffer rows behind each client's g_ref^k [C]
    manipulation: str = choice("project", MANIPULATIONS)  # project | average | rotate | project_scale (Table 7)
    apply: str = choice("conflict", APPLY)  # conflict (> 90 degrees) | always (Table 7)
    rate: float = number(1.0, minimum=0, maximum=1)  # projection rate p (Table 8); 0: FedGP off

    def check(self) -> None:
        if self.base == "fedgp" or self.base not in METHODS.names():
            allowed = [n for n in METHODS.names() if n != "fedgp"]
            raise ValueError(f"base={self.base!r}; allowed: {', '.join(allowed)}")
        try:
            base_buffer = base_buffer_size(self.base, self.base_params)  # a replay base (A-GEM, DER)
        except FedForgetError as e:
            raise ValueError(str(e)) from None
        if base_buffer == 0:  # [D] no g_ref ever: FedGP would silently be its base
            raise ValueError(
                f"base_params.buffer_size=0 (base '{self.base}'): FedGP without buffer rows is its base "
                "alone; allowed: an integer >= 1 (or run the base by itself)"
            )
        if base_buffer is not None:
            if self.buffer_size is not None and self.buffer_size != base_buffer:
                raise ValueError(
                    f"buffer_size={self.buffer_size} but base '{self.base}' keeps its own buffer of "
                    f"base_params.buffer_size={base_buffer}, which FedGP reads; allowed: leave buffer_size "
                    f"unset (or equal) and set base_params.buffer_size"
                )
            if self.buffer_policy != "reservoir":
                raise ValueError(
                    f"buffer_policy={self.buffer_policy!r} over base '{self.base}', whose buffer is a "
                    "reservoir; allowed: reservoir (other policies need a base without a buffer, e.g. fedavg)"
                )


def manipulate(
    g: Sequence[torch.Tensor], g_ref: Sequence[torch.Tensor], how: str, always: bool, gate: torch.Tensor | None,
    stacked: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(g', applied, cos) for the flat vector made of ``g`` and ``g_ref`` (Table 7's
    manipulations, see the module docstring): ``applied`` (0-d bool) where the step
    qualifies (conflict, or always; g_ref != 0) and ``gate`` (the projection rate's draw)
    allows it; cos = cos(g, g_ref) before. The projection is ``shared.project``.
    ``stacked``: each client of a stack at once (``g``'s tensors [G, ...], one ``g_ref``
    for all, ``gate`` [G]; applied and cos [G]), as each alone."""
    proj, applied, cos = project(g, g_ref, eps=EPS, norm_guard=0.0, always=always, stacked=stacked)
    if gate is not None:
        applied = applied & gate
    if how == "project":
        out = proj
    else:
        gn = torch.sqrt(flat_dot(g, g, stacked))
        if how == "project_scale":
            pn = torch.sqrt(flat_dot(proj, proj, stacked))
            out = [a * per_client(gn / pn.clamp_min(1e-30), a, stacked) for a in proj]
        elif how == "average":
            out = [(a + b) / 2 for a, b in zip(g, g_ref)]
        else:  # rotate: half-way to g_ref, magnitude kept
            rn = torch.sqrt(flat_dot(g_ref, g_ref))
            u = [a / per_client(gn.clamp_min(1e-30), a, stacked) + b / rn.clamp_min(1e-30) for a, b in zip(g, g_ref)]
            un = torch.sqrt(flat_dot(u, u, stacked))
            applied = applied & (un > 0)  # g exactly opposite g_ref: no bisector, unchanged
            out = [a * per_client(gn / un.clamp_min(1e-30), a, stacked) for a in u]
    return [torch.where(per_client(applied, a, stacked), o, a) for o, a in zip(out, g)], applied, cos


@METHODS.register("fedgp")
class FedGP(OverBase):
    name = "fedgp"
    one_task_per_class = True  # its buffer labels a row's task by its class (methods.replay)
    own_exchanges = (ROUND_END,)  # the buffer gradients g_ref^k after each aggregation
    round_end_untrained = True  # from every sampled client with buffer rows, trained or not
    stacked_replies = (ROUND_END,)  # the stacked trainer's clients take their g_ref^k in one pass
    # the manipulation is a gradient map of the step terms: stacked over a stacked base
    stacks_with_base, step_terms = True, True
    stacks_over_live = True  # over iCaRL, GLFC, LANDER: its map follows their live step's gradient
    Params = FedGPParams

    def __init__(self, params: FedGPParams, info: RunInfo) -> None:
        super().__init__(params, info)
        self.sees_step = self.base.sees_step  # the base's terms read the step's minibatch (A-GEM)
        # a base whose step is live terms (iCaRL, GLFC): its loss, then the projection (step terms)
        self.live_terms, self.step_rows = self.base.live_terms, self.base.step_rows
        size = self.own_buffer_size(params)
        self.own_buffer = size is not None
        if self.own_buffer:
            self.replay = Replay(info, size, OWN_STREAM, policy=params.buffer_policy)
        else:
            self.replay = self.base.replay  # the base's Replay (A-GEM, DER, iCaRL's exemplars, SCR)

    @staticmethod
    def own_buffer_size(params: FedGPParams) -> int | None:
        """The rows of FedGP's own buffer; None over a base that keeps one, a base whose params
        have ``buffer_size`` (A-GEM, DER, iCaRL, SCR: its ``replay``), which FedGP reads."""
        if base_buffer_size(params.base, params.base_params) is not None:
            return None
        return DEFAULT_BUFFER if params.buffer_size is None else params.buffer_size

    @classmethod
    def client_kept_bytes(cls, params: FedGPParams, shape: ClientShape) -> int | None:
        """Its base's, and its own buffer of (x, y, task) rows where the base keeps none."""
        base = super().client_kept_bytes(params, shape)
        own = cls.own_buffer_size(params)
        return None if base is None else base + (0 if own is None else buffer_bytes(own, shape))

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        out = dict(self.base.server_broadcast(server))
        g_ref = server.state.get(STATE_KEY)
        if g_ref is not None:
            out[STATE_KEY] = g_ref
        return out

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        """ROUND_END: g_ref = mean of the clients' buffer gradients (None if no buffer had
        rows), after the base's own round-end step on its part of the replies. Any other
        exchange is the base's."""
        if exchange != ROUND_END:
            self.base.server_collect(exchange, server, replies)
            return
        if ROUND_END in self.base.exchanges:
            self.base.server_collect(ROUND_END, server, {c: r[0] for c, r in replies.items() if r[0] is not None})
        grads = [r[1] for r in replies.values() if r[1] is not None]
        server.state["fedgp_ref_clients"] = len(grads)
        if not grads:
            server.state[STATE_KEY] = None
            return
        names = list(dict.fromkeys(n for g in grads for n in g))
        mean = {}
        for n in names:
            parts = [g[n] for g in grads if n in g]  # a parameter outside a client's graph: 0
            mean[n] = torch.stack(parts).sum(0) / len(grads)
        server.state[STATE_KEY] = mean

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        out = super().server_metrics(server, uploads)
        g_ref = server.state.get(STATE_KEY)
        if g_ref is not None:
            out["ref_norm"] = math.sqrt(sum(float((v * v).sum()) for v in g_ref.values()))
        out["ref_clients"] = float(server.state.get("fedgp_ref_clients", 0))
        return out

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        self.base.client_begin(ctx)
        s = self.scratch(ctx)
        s.stack = None
        if self.own_buffer:
            self.replay.begin(ctx, s)
        g_ref = ctx.broadcast.get(STATE_KEY)
        # (parameter, its g_ref part): zeros for a parameter outside the reference's graph
        s.pairs = (
            None
            if g_ref is None
            else [
                (p, g_ref[n] if n in g_ref else torch.zeros_like(p))
                for n, p in ctx.model.named_parameters()
                if p.requires_grad
            ]
        )
        s.gates = None  # the rate's draw of each step (StepDraws)
        if s.pairs is not None and 0 < self.p.rate < 1:
            gen = torch.Generator().manual_seed(torch_seed(self.info.seed, ctx.round, ctx.cid, ctx.task, RATE_STREAM))
            draws = torch.stack([torch.rand((), generator=gen) < self.p.rate for _ in range(ctx.max_steps)])
            s.gates = StepDraws(draws, self.info.device)
        s.n_applied = torch.zeros((), device=self.info.device)
        s.cos_sum = torch.zeros((), device=self.info.device)
        s.n_ref = 0
        s.batch = None

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.base.client_step(ctx, x, y)
        if self.own_buffer:
            self.scratch(ctx).batch = (x, y)  # offered in client_grad
        return loss

    def client_grad(self, ctx: ClientContext) -> None:
        self.base.client_grad(ctx)  # the base's own terms first [P Alg. 5-6, C]
        s = self.scratch(ctx)
        if s.pairs is not None and self.p.rate > 0:
            pairs = [(p, r) for p, r in s.pairs if p.grad is not None]
            gate = None if s.gates is None else s.gates.next()
            g = [p.grad for p, _ in pairs]
            with torch.no_grad():
                new, applied, cos = manipulate(
                    g, [r for _, r in pairs], self.p.manipulation, self.p.apply == "always", gate
                )
                torch._foreach_copy_(g, new)
            s.n_applied += applied
            s.cos_sum += cos
            s.n_ref += 1
        elif s.pairs is not None:  # rate 0: diagnostics only, g untouched
            with torch.no_grad():
                pairs = [(p, r) for p, r in s.pairs if p.grad is not None]
                _, _, cos = project([p.grad for p, _ in pairs], [r for _, r in pairs], EPS, 0.0)
            s.cos_sum += cos
            s.n_ref += 1
        if s.batch is not None:
            x, y = s.batch
            s.batch = None
            self.replay.offer(ctx, s, x, y)

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> Any:
        """The stacked form of the step (``client_grad``): the base's terms, then as the
        gradient map ``manipulate`` of each client's whole gradient against the one g_ref of
        the round (its rate draws from each client's own generator, one per step, as alone);
        the diagnostics' sums kept per client of the stack (``s.stack``). The base alone
        where the round has no g_ref. The buffer's offers wait for ``client_end``."""
        base = self.base.client_step_terms(ctxs) if self.base.step_terms else None
        g_ref = ctxs[0].broadcast.get(STATE_KEY)
        if g_ref is None:
            return base
        p, dev = self.p, self.info.device
        # per client: steps manipulated, sum of cos
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 2, dev, "stack")
        scratches = [self.scratch(c) for c in ctxs]

        def manipulated(lo: int, hi: int, grads: dict[str, Any]) -> dict[str, Any]:
            """Clients lo..hi-1's gradients after the manipulation. A parameter the base holds
            (None; GPM's biases) is left out of the flat vector, as its p.grad = None leaves
            it out of a client alone's; where the base holds it for some clients only
            (``Held``), each client is manipulated on its own."""
            if hi - lo > 1 and any(isinstance(v, Held) for v in grads.values()):
                own = [lambda g, i=i: manipulated(i, i + 1, g) for i in range(lo, hi)]
                return each_client(own, grads)
            if hi - lo == 1:  # a Held of one client: None, or its gradient
                grads = {n: (None if bool(v.held[0]) else v.grad) if isinstance(v, Held) else v for n, v in grads.items()}
            names = [n for n, v in grads.items() if v is not None]
            g = [grads[n] for n in names]
            r = [g_ref[n] if n in g_ref else torch.zeros_like(grads[n][0]) for n in names]
            if p.rate == 0:  # diagnostics only, g untouched
                sums[1, lo:hi] += project(g, r, EPS, 0.0, stacked=True)[2]
                return grads
            gate = None
            if scratches[lo].gates is not None:
                gate = torch.stack([scratches[i].gates.next() for i in range(lo, hi)])
            new, applied, cos = manipulate(g, r, p.manipulation, p.apply == "always", gate, stacked=True)
            sums[0, lo:hi] += applied
            sums[1, lo:hi] += cos
            return {**grads, **dict(zip(names, new))}

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor], *step: Any):
            # step: the step's minibatch, for a base whose terms see it (A-GEM: sees_step)
            loss, add, base_map = base(lo, hi, w, *step) if base is not None else (None, None, None)

            def gmap(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                return manipulated(lo, hi, grads if base_map is None else base_map(grads))

            return loss, add, gmap

        return PlannedTerms.like(base, terms)  # keyed as the base's steps (A-GEM's, DER's plan)

    def client_end(self, ctx: ClientContext) -> Upload:
        s = self.scratch(ctx)
        if s.stack is not None:  # trained in a stack: its sums, one per step with a g_ref
            col = s.stack.column()
            s.n_applied, s.cos_sum, s.n_ref = col[0], col[1], ctx.steps
        if self.own_buffer and s.to_offer > 0 and ctx.minibatches is not None:
            for x, y in ctx.minibatches(0):  # no step offered (a stacked pass): the first epoch's
                self.replay.offer(ctx, s, x, y)  # minibatches in their order, as client_grad would
        up = super().client_end(ctx)  # the base's upload, its diagnostics renamed
        ctx.stats["proj_share"] = s.n_applied.item() / max(ctx.steps, 1)
        if s.n_ref:
            ctx.stats["cos_before"] = s.cos_sum.item() / s.n_ref
        if self.own_buffer:
            ctx.stats["buffer_size"] = float(self.replay.buffer.size(ctx.state))
        for t, n in enumerate(self.replay.task_counts(ctx.state)):
            ctx.stats[f"buffer_task{t}"] = float(n)
        return up

    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        """ROUND_END: ``client_replies`` of this client alone; any other exchange is the base's."""
        if exchange != ROUND_END:
            return self.base.client_reply(exchange, ctx)
        return self.client_replies(ROUND_END, [ctx], grads_alone(ctx.model))[0]

    def client_replies(self, exchange: str, ctxs: Sequence[ClientContext], grads: ReplyGrads) -> list[Any]:
        """ROUND_END: each client's (the base's reply, g_ref^k), g_ref^k the mean CE gradient
        at the new global model on a random batch of the client's buffer (Alg. 3), None while
        the buffer is empty; the clients whose batches have as many rows take theirs in one
        ``grads`` pass (the stacked trainer: ``stacked_replies``). The base's reply from a
        client that trained, or from any where the base's reply needs no new rows (its
        ``round_end_untrained``). Any other exchange is the base's."""
        if exchange != ROUND_END:
            return self.base.client_replies(exchange, ctxs, grads)
        out: list[list[Any]] = []
        mems: dict[int, dict[str, torch.Tensor]] = {}
        for i, ctx in enumerate(ctxs):
            base_reply = None
            if ROUND_END in self.base.exchanges and (self.base.round_end_untrained or len(ctx.data)):
                base_reply = self.base.client_reply(ROUND_END, ctx)
            out.append([base_reply, None])
            gen = sample_generator(self.info.seed, ctx.round, ctx.cid, ctx.task, REF_STREAM)
            mem = self.replay.buffer.sample(ctx.state, self.p.ref_batch_size, gen)
            if mem is not None:
                mems[i] = mem
        by_rows: dict[int, list[int]] = {}
        for i, mem in mems.items():
            by_rows.setdefault(len(mem["y"]), []).append(i)
        for group in by_rows.values():
            x, y, task = (torch.stack([mems[i][k] for i in group]) for k in ("x", "y", "task"))

            def losses(logits: torch.Tensor, lo: int, y: torch.Tensor = y) -> torch.Tensor:
                return torch.stack([F.cross_entropy(z, y[lo + i]) for i, z in enumerate(logits)])

            g = grads(x, task, losses, group)
            for j, i in enumerate(group):
                out[i][1] = {n: v[j] for n, v in g.items()}
        return [tuple(o) for o in out]
