"""FedProj (Chunduru, Morafah, Morafah, Chellapandi, Li: "Avoid Forgetting by Preserving
Global Knowledge Gradients in Federated Learning with Non-IID Data"; papers/fedproj.md).

Client step (Sec. 4.2, Algorithm 1 lines 7-10), for every private minibatch (x, y) of client k:

    g_new  = grad_theta CE(f(x; theta_k), y)                                   (Eq. 2)
    L_mem  = 1/|M| sum_{x_m in M} KL( sigma(Z_server(x_m)/T) || sigma(Z_k(x_m)/T) )  (Eq. 3)
    g_glob = grad_theta L_mem,  M = one random batch of the public set per step
    g_proj = g_new                                       if <g_new, g_glob> >= 0
           = g_new - <g_new,g_glob>/(||g_glob||^2 + eps) g_glob   otherwise      (Eq. 14 / 5)
    theta_k <- optimizer step with g_proj                                       (Eq. 6)

Z_server is the *memory*: the uniform mean of last round's sampled clients' logits on the
public set (their local models after local training, eval mode), kept in ``server.state``.
(Eq. 14) solves the quadratic program (Eq. 5): the closest direction to g_new that does not
increase L_mem to first order (Eq. 4). Gradients are one flat vector over every parameter
with a gradient [C]. Backward computes g_new as FedAvg does; g_glob (one more forward and
backward on a public batch) and the projection are the method's step terms
(``client_step_terms``: written once for a stack of clients, a client alone a stack of one;
the batched engine runs them for the whole stack [D, issue 32], except with local_lr_step,
whose lr falls within a client's round: sequential).

Server step (Sec. 4.3, Algorithm 1 lines 16-28): theta_avg = sum_k n_k/n theta_k (Eq. 1);
the student starts at theta_avg and runs E_d epochs over the public set minimising

    T^2 * KL( sigma(Z_teacher/T) || sigma(Z_student/T) )                       (Eq. 7, L_KD)
    + alpha * ||theta - theta_avg||_2^2                                         (L_div, Eq. 8)
    [+ gamma2 * mean_x ||h_student(x) - mean_k h_k(x)||^2]      (feature distillation, option)

with Z_teacher = 1/|S_t| sum_k f(X; theta_k) (uniform, not n_k-weighted), through the shared
``fedforget.methods.distill.distill`` (as FedDF, which this class subclasses). The same ensemble
logits become next round's memory Z_server.

Switches (``Params``) and their sources: [P] paper, [C] the authors' code (per METHODS.md),
[D] our decision where the two are silent or disagree.
- ``temperature`` = 3 [C] for both L_mem and L_KD (Eq. 3 and 7 print no temperature; the
  paper's Sec. 5.1 gives T = 3 for distillation). L_mem carries no T^2 factor [C]; L_KD does
  (Algorithm 1 line 24).
- ``memory_loss``: kl (Eq. 3, code; default) | ce: Algorithm 1 line 9's variant, the
  cross-entropy of the local model on a *labelled* public batch [P]. The class may read the
  public labels (``public_labels = True``), but ``server_init`` discards them unless
  memory_loss = ce, so the default method never sees them. With ce no teacher is needed and
  projection can start in round 1.
- ``memory_batch_size`` = 256 [C]: |M|, a fresh random public batch per step (the whole
  public set when it is smaller), drawn from a generator keyed (seed, round, client, 0x60);
  its forward runs in the model's training mode (BatchNorm statistics would see it). The
  cost per step is one extra forward/backward on |M| rows: with a public set much larger
  than the private batch, |M| = 256 costs several times a FedAvg step.
- ``eps`` = 1e-8 [D] (Eq. 14's epsilon; its value is given nowhere); ``norm_guard`` = 1e-6 [C]:
  no projection when ||g_glob||^2 <= norm_guard (small-norm guard).
- ``coef_clamp`` = 0 (off) [P]; the code clamps the coefficient <g_new,g_glob>/(||g_glob||^2+eps)
  to [-10, 10] (set 10 for the code's behaviour) [C].
- No memory before a teacher exists [D]: in round 1 (kl) there is no projection; the code feeds
  random logits as the teacher instead (not copied).
- ``projection`` = true; false turns the client step into FedAvg's (g_glob is not computed).
- ``proj_warmup_rounds`` = 0 [D] (code: 6 or 10): no projection in rounds 1..warmup;
  ``proj_cooldown_rounds`` = 0 [D] (code: off in the last rounds): none in the last n rounds.
- ``proj_dropout`` = 0 [D] (code: 0.7 in some headline runs; Fig. 3a sweeps the projection
  rate 1 - p): a client skips projection for a whole round with probability p, drawn from a
  generator keyed (seed, round, client, 0x61).
- ``local_lr_step`` = false [C off]: the code's StepLR (x0.1 every floor(E/2) local epochs,
  optimizer rebuilt each round). The local optimizer itself (paper/code: Adam lr 1e-3, code
  weight decay 5e-5) is the experiment's ``train.optimizer``, set in the configs.
- Server: ``distill_epochs`` E_d = 1 [P] (3 for CIFAR-100); ``distill_optimizer`` adam,
  ``distill_lr`` = 1e-5 [C] (the paper gives no eta_distill); ``distill_batch_size`` = 256 [P]
  (code 128); ``distill_schedule`` constant [D].
- ``alpha`` = 0.3 [D]: weight of L_div. The anchor is theta_avg (the text's intent) [D]; in
  the code the anchor aliases the live parameters, so the term is always zero (not copied;
  alpha = 0 reproduces it). Table 3b: alpha = 0 is best at Dir 0.3, 0.3 or 0.5 at Dir 0.5;
  0.3 is the value of the headline CIFAR-10 / CINIC-10 Dir 0.5 entries.
- ``gamma2`` = 0 (off) [D]: feature distillation, undefined in the paper; the code adds gamma2
  (1e-4..3e-4) times a masked L2 between student and mean teacher penultimate features.
  Here: gamma2 * batch mean of the squared L2 distance, no mask (the code's mask is not
  documented) [D]. Clients then also upload their penultimate features on the public set.
- Not copied: the code casts public images and teacher logits to int64 before the loss.

Diagnostics, per round (columns ``fedproj_<key>``): ``proj_share`` (share of local steps
projected, mean over clients), ``cos_before`` (mean over steps with a memory gradient of
cos(g_new, g_glob) before projection), ``mem_loss_before`` (the memory loss of the broadcast
global model on the whole public set) and ``mem_loss_after`` (of each local model after local
training, mean over clients), plus the distillation's (``distill_*``). The forgetting that
FedProj claims to prevent is also in every run's ``local_models_global_test_acc_mean``.
With projection off and distill_epochs = 0 the method is FedAvg bit-exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..utils import FedForgetError, torch_seed
from .base import ClientContext, ServerContext, StepBatch, StepTerms, Upload
from .distill import DistillParams, public_logits, softened_kl, softened_kl_stacked
from .feddf import PUBLIC_LOGITS, PUBLIC_X, FedDF
from .params import boolean, choice, integer, number, redefault
from .registry import METHODS
from .shared import StepDraws, StepSums, project

MEMORY_STREAM, DROPOUT_STREAM = 0x60, 0x61  # keyed randomness: memory batches, dropout
MEMORY_LOSSES = ("kl", "ce")
TEACHER = "fedproj_teacher"  # server.state / broadcast key: the memory Z_server [N_pub, C]
PUBLIC_Y = "public_y"  # broadcast key (memory_loss = ce): public labels
PUBLIC_FEATURES = "public_features"  # upload key (gamma2 > 0): penultimate features [N_pub, D]


def memory_kl(logits: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. 3: batch mean of KL(softmax(teacher/T) || softmax(logits/T)), no T^2 factor."""
    return softened_kl(logits, teacher, temperature)


def weight_divergence(
    model: torch.nn.Module, anchor: dict[str, torch.Tensor], alpha: float
) -> torch.Tensor:
    """L_div (Eq. 8's second term): alpha * ||theta - theta_avg||_2^2 over the trainable
    parameters; its gradient is 2 * alpha * (theta - theta_avg)."""
    terms = [((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if p.requires_grad]
    return alpha * torch.stack(terms).sum()


@METHODS.register("fedproj")
class FedProj(FedDF):
    name = "fedproj"
    # [D] each step's memory gradient and projection are step terms that see the step (their
    # memory batch goes through the step's weights). stacked = False for the class: its
    # client_step drops the lr within the round with local_lr_step; every other form stacks
    # (``trait``), its client_step then FedAvg's
    stacked = False
    step_terms = True
    sees_step = True
    needs_public = True
    public_labels = True  # only the memory_loss = ce variant reads them; dropped otherwise

    @dataclass(frozen=True)
    class Params(DistillParams):
        temperature: float = number(3.0, exclusiveMinimum=0)  # T of L_mem and L_KD [C]
        memory_loss: str = choice("kl", MEMORY_LOSSES)  # kl (Eq. 3) | ce (Algorithm 1, labelled public data)
        memory_batch_size: int = integer(256, minimum=1)  # |M| per step [C]
        eps: float = number(1e-8, minimum=0)  # Eq. 14 [D]
        norm_guard: float = number(1e-6, minimum=0)  # no projection when ||g_glob||^2 <= this [C]
        coef_clamp: float = number(0.0, minimum=0)  # > 0: clamp Eq. 14's coefficient to +-this (code: 10)
        projection: bool = boolean(True)  # false: FedAvg's client step
        proj_warmup_rounds: int = integer(0, minimum=0)  # no projection in rounds 1..n (code: 6 or 10)
        proj_cooldown_rounds: int = integer(0, minimum=0)  # no projection in the last n rounds
        proj_dropout: float = number(0.0, minimum=0, maximum=1)  # P(skip projection for a client-round) (Fig. 3a: 1 - rate)
        local_lr_step: bool = boolean(False)  # code: local lr x0.1 every floor(E/2) epochs
        alpha: float = number(0.3, minimum=0)  # weight divergence L_div weight [D]
        gamma2: float = number(0.0, minimum=0)  # feature distillation weight (code 1e-4..3e-4), off
        distill_lr: float = redefault(DistillParams, "distill_lr", 1e-5)  # [C]
        distill_batch_size: int = redefault(DistillParams, "distill_batch_size", 256)  # [P] (code 128)

    @classmethod
    def trait(cls, name: str, params=None) -> bool:
        """``stacked``: true unless local_lr_step (the code's StepLR: each client's lr falls
        after its own number of steps within the round, which one stacked step does not do;
        ``client_step`` does it one client at a time)."""
        if name == "stacked":
            return params is not None and not params.local_lr_step
        return super().trait(name, params)

    # ---------------------------------------------------------------- server side
    def server_init(self, server: ServerContext) -> None:
        super().server_init(server)
        if self.p.memory_loss == "ce":
            if server.public.y is None:
                raise FedForgetError("fedproj memory_loss='ce' needs public labels, but the public set has none")
        else:
            server.public.y = None  # the label-free default never sees them

    def server_broadcast(self, server: ServerContext) -> dict:
        out = super().server_broadcast(server)
        teacher = server.state.get(TEACHER)
        out[TEACHER] = teacher
        if self.p.memory_loss == "ce":
            out[PUBLIC_Y] = server.public.y
        # memory loss of the broadcast global model (every client starts from it)
        if teacher is not None or self.p.memory_loss == "ce":
            z = public_logits(self.global_model(server), server.public.x, self.info.train.eval_batch_size)
            server.state["fedproj_mem_before"] = self.memory_value(z, out)
        return out

    def global_model(self, server: ServerContext) -> torch.nn.Module:
        server.model.load_state_dict(server.global_params)
        return server.model

    def memory_value(self, logits: torch.Tensor, broadcast: dict) -> float:
        """L_mem over the whole public set (the diagnostic, not the per-step batch)."""
        if self.p.memory_loss == "ce":
            return F.cross_entropy(logits, broadcast[PUBLIC_Y]).item()
        return memory_kl(logits, broadcast[TEACHER], self.p.temperature).item()

    def teacher_logits(self, uploads: Sequence[Upload]) -> torch.Tensor:
        """Z_teacher = Z_server: uniform mean of the sampled clients' public logits."""
        return torch.stack([u.extras[PUBLIC_LOGITS] for u in uploads]).mean(0)

    def distillation(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        teacher = self.teacher_logits(uploads)
        server.state[TEACHER] = teacher  # next round's memory (Eq. 3's Z_server)
        if self.p.distill_epochs == 0:
            return
        anchor = {k: v.detach().clone() for k, v in server.global_params.items()}  # theta_avg
        alpha = float(self.p.alpha)

        def l_div(student: torch.nn.Module) -> torch.Tensor:
            return weight_divergence(student, anchor, alpha)

        batch_loss = None
        if self.p.gamma2 > 0:
            h_teacher = torch.stack([u.extras[PUBLIC_FEATURES] for u in uploads]).mean(0)
            gamma2 = float(self.p.gamma2)

            def batch_loss(idx, features, logits):  # feature distillation
                return gamma2 * ((features - h_teacher[idx]) ** 2).sum(1).mean()

        extra = l_div if alpha > 0 else None
        self.distill_server(server, teacher, self.p.temperature, batch_loss, extra)

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        out = super().server_metrics(server, uploads)
        if "fedproj_mem_before" in server.state:
            out["mem_loss_before"] = server.state.pop("fedproj_mem_before")
        return out

    # ---------------------------------------------------------------- client side
    def projection_active(self, ctx: ClientContext) -> bool:
        """Whether client ctx.cid projects in round ctx.round (memory, schedule, dropout)."""
        p, rounds = self.p, self.info.train.rounds
        if not p.projection:
            return False
        if p.memory_loss == "kl" and ctx.broadcast.get(TEACHER) is None:
            return False  # round 1: no memory yet [D]
        if ctx.round <= p.proj_warmup_rounds or ctx.round > rounds - p.proj_cooldown_rounds:
            return False
        if p.proj_dropout > 0:
            gen = torch.Generator().manual_seed(torch_seed(self.info.seed, ctx.round, ctx.cid, DROPOUT_STREAM))
            if torch.rand((), generator=gen).item() < p.proj_dropout:
                return False
        return True

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)  # this client-round's working values
        s.active = self.projection_active(ctx)
        s.sums = StepSums.own(3, self.info.device)  # steps projected, sum of cos, steps with a memory batch
        spe = self.info.train.epoch_steps(ctx.n_samples, ctx.batch_size)  # steps per local epoch (drop_last too)
        s.memory = self.memory_rows(ctx) if s.active else None  # (StepDraws; None: the whole public set)
        s.lr_step_every = (ctx.local_epochs // 2) * spe if self.p.local_lr_step else 0

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        every = self.scratch(ctx).lr_step_every
        if every and ctx.steps and ctx.steps % every == 0:
            for group in ctx.optimizer.param_groups:  # the code's StepLR(E/2, 0.1) [C]
                group["lr"] *= 0.1
        return super().client_step(ctx, x, y)  # g_new in p.grad (Eq. 2)

    def memory_rows(self, ctx: ClientContext) -> StepDraws | None:
        """The memory batch M of each of the client's steps: indices into the public set, one
        draw per step from the client's keyed generator, made at its start (``StepDraws``);
        None: the whole public set, when it is no larger than |M|."""
        n, b = len(ctx.broadcast[PUBLIC_X]), self.p.memory_batch_size
        if n <= b:
            return None
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, ctx.round, ctx.cid, MEMORY_STREAM))
        draws = torch.stack([torch.randperm(n, generator=gen)[:b] for _ in range(ctx.max_steps)])
        return StepDraws(draws, self.info.device)

    def step_memory(self, ctx: ClientContext) -> torch.Tensor | None:
        """This step's memory batch (None: the whole public set)."""
        memory = self.scratch(ctx).memory
        return None if memory is None else memory.next()

    def memory_losses(self, logits: torch.Tensor, idx: list[torch.Tensor | None], broadcast: dict) -> torch.Tensor:
        """L_mem (Eq. 3, or Algorithm 1's CE) of each client of a stack on its memory batch:
        ``logits`` [G, |M|, C], ``idx`` each client's rows of the public set; [G]. A client
        alone takes the batch-mean functions themselves (``memory_kl``, cross-entropy)."""
        def target(key: str, i: torch.Tensor | None) -> torch.Tensor:
            t = broadcast[key]
            return t if i is None else t[i]

        if len(idx) == 1:
            if self.p.memory_loss == "ce":
                return F.cross_entropy(logits[0], target(PUBLIC_Y, idx[0])).unsqueeze(0)
            return memory_kl(logits[0], target(TEACHER, idx[0]), self.p.temperature).unsqueeze(0)
        if self.p.memory_loss == "ce":
            ys = torch.stack([target(PUBLIC_Y, i) for i in idx])
            return F.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="none").view(ys.shape).mean(1)
        return softened_kl_stacked(logits, torch.stack([target(TEACHER, i) for i in idx]), self.p.temperature)

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms | None:
        """The step of each client of a stack that projects this round (``projection_active``):
        its memory batch M through the step's weights (training mode, as the private
        batch), g_glob = grad L_mem (Eq. 3), and the step's gradient projected against it
        (Eq. 14, ``project``) by the map; the others' gradients unchanged. Per client: steps
        projected, the sum of cos(g_new, g_glob), steps with a memory batch (``s.sums``)."""
        act = [self.scratch(c).active for c in ctxs]
        if not any(act):
            return None
        p, dev = self.p, self.info.device
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 3, dev)
        on = torch.tensor(act, device=dev)
        bc = ctxs[0].broadcast
        x_pub = bc[PUBLIC_X]

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch):
            own = act[lo:hi]
            idx = [self.step_memory(c) if a else None for c, a in zip(ctxs[lo:hi], own)]
            if not any(own):
                return None, None, None
            first = next(i for i, a in zip(idx, own) if a)  # an idle client's rows: any (its gradient is dropped)
            idx = [i if a else first for i, a in zip(idx, own)]
            xs = torch.stack([x_pub if i is None else x_pub[i] for i in idx])
            rows = [xs.shape[1] if a else 0 for a in own]  # an idle client runs no memory batch (BatchNorm)
            losses = self.memory_losses(step.forward(w, xs, None, rows), idx, bc)
            g_glob = step.grad((losses * on[lo:hi]).sum(), w)

            def gmap(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                names = [n for n, v in grads.items() if v is not None]
                g, r = [grads[n] for n in names], [g_glob[n] for n in names]
                if hi - lo == 1:  # a client alone: its own flat vectors
                    new, projected, cos = project([a[0] for a in g], [b[0] for b in r], p.eps, p.norm_guard, p.coef_clamp)
                    new = [a.unsqueeze(0) for a in new]
                else:
                    new, projected, cos = project(g, r, p.eps, p.norm_guard, p.coef_clamp, stacked=True)
                    keep = on[lo:hi]
                    new = [torch.where(keep.view(-1, *[1] * (a.dim() - 1)), a, b) for a, b in zip(new, g)]
                    projected, cos = projected & keep, torch.where(keep, cos, torch.zeros_like(cos))
                sums[0, lo:hi] += projected
                sums[1, lo:hi] += cos
                sums[2, lo:hi] += on[lo:hi]
                return {**grads, **dict(zip(names, new))}

            return None, None, gmap

        return terms

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)  # weights + eval-mode public logits (FedDF)
        projected, cos, with_memory = self.scratch(ctx).sums.values()
        ctx.stats["proj_share"] = projected / max(ctx.steps, 1)
        if with_memory:
            ctx.stats["cos_before"] = cos / with_memory
        if ctx.broadcast.get(TEACHER) is not None or self.p.memory_loss == "ce":
            ctx.stats["mem_loss_after"] = self.memory_value(up.extras[PUBLIC_LOGITS], ctx.broadcast)
        if self.p.gamma2 > 0:
            with torch.no_grad():
                was = ctx.model.training
                ctx.model.eval()
                up.extras[PUBLIC_FEATURES] = ctx.model.features(ctx.broadcast[PUBLIC_X]).detach()
                ctx.model.train(was)
        return up
