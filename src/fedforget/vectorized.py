"""Clients trained together: one batched forward/backward for all sampled clients per step.

The sampled clients' weights are stacked along a leading client dimension [G, ...] and one
forward/backward per step computes every client's gradient from its own weights and its own
minibatch; the local optimizer (SGD with momentum and weight decay, as ``torch.optim.SGD``,
or Adam, as ``torch.optim.Adam``: ``adam_update_``) runs on the stacked tensors. Two ways to run the stacked forward:

- ``stacked_forward`` (used when every module of the model is one it knows: Conv1d/Conv2d,
  Linear, ReLU/Tanh/Sigmoid/GELU, max/avg pooling, Flatten, Identity, nested Sequential,
  BatchNorm2d, GroupNorm, LayerNorm, the ResNets' ``ResNetBody`` and ``BasicBlock``
  (torchvision's too), SL-ViT and torchvision's ViT (``_stacked_slvit``, ``_stacked_vit``),
  per-task heads (the active head; replayed rows through their own task's head,
  ``head_scores``), the ``Classifier`` wrapper, a frozen Hugging Face encoder, ``HFBody``, run once over every client's rows: the
  same map for all, its features kept per row, ``fedforget.featcache``, its parameters and
  constant buffers not stacked, a training one if a BERT, ``_stacked_hf``): each layer written once for G clients, with plain autograd. Convolutions keep the
  clients in the channel dimension, [B, G*C, ...], and run as one grouped convolution
  (groups = G x the layer's groups); ReLU, pooling, BatchNorm (per channel: each client's
  statistics over its own rows) and GroupNorm (G x its groups) act on that layout as it is;
  Flatten turns it into [G, B, F] once, and Linear layers are one batched matmul
  (``baddbmm``). The loss is the sum over clients of each client's own mean loss, so each
  client's slice of the gradient is exactly its own loss's gradient. On a GPU the ResNets
  run in channels_last (``CHANNELS_LAST``).
- otherwise ``torch.func.vmap`` over ``functional_call`` of the model (any module without
  randomness, BatchNorm's statistics passed as stacked buffers), which reshapes between the
  two layouts at every layer.

On a CPU, Conv2d models run their wide steps (>= ``LOOP_MIN_ROWS`` rows) client by client
(a grouped Conv2d over many rows is slower there than a loop), spread over the process's
intra-op threads used as workers of one thread each (a small convolution gains little from
a second intra-op thread, while two clients side by side use both cores), and their short
steps batched.

Each client keeps its own numerics:

- the same minibatches as when it trains alone (``Simulation.train_client``): its shuffling
  generator is keyed by (seed, round, client), so its permutation of each epoch is the same;
- its own batch sizes, the last batch of an epoch included: a step's batches are padded to
  the largest real batch among the clients in it (not to the batch size, so equal-sized
  clients' short tail batches cost only their rows) and the padded rows are masked out of
  the loss (sum of the real rows' losses divided by their number = the mean the sequential
  loop takes);
- its own number of steps: clients are ordered by step count (descending), so those still
  training at step k are a prefix of the stack and the finished ones are sliced off (their
  weights and momentum stop moving, and cost nothing).

The results match the sequential loop up to floating-point summation order (a test checks
1e-5 on a tiny config). The engine uses this path only where it computes the same thing:
the method declares its local training FedAvg's step (``stacked``; a method's own
``client_end``, e.g. FedNova's or FedDF's, runs per client afterwards: ``own_upload``), with
its change, if any, stated as per-step loss and gradient terms for the stacked clients
(``step_terms``: ``FedAvg.client_step_terms``, their one definition: FedProx, FedDyn,
SCAFFOLD, FedCurv; projections as a map of the step's gradient: GPM, FedProTIP, FedGP; and,
for a method that ``sees_step``, terms of the step's minibatch: A-GEM's and DER's memory
batches, each client's from its own buffer, TARGET's synthetic batches, forwarded as one
stack; ``live_terms``: terms of the step's own forward pass, ``FedAvg.client_live_terms``,
a loss of its logits, FedNTD, or of what the body's own stacked forward kept, L2P's pull
term (a body with ``stacked_body`` runs itself: L2P's prompted frozen ViT, once over the
stack's rows), the step's whole loss, LANDER, over rows of the method's own joined to each
client's minibatch, iCaRL, GLFC, LGA, or put in its place, CFeD's reviewers (``JoinedLive``),
or a second pass at perturbed weights, FedSAM, FedASAM, FedSOL, for models
``stacked_forward`` runs, a plug-in's step terms following them (FedGP over iCaRL); a method that cuts
its epochs, TARGET's code rule, has them cut per client, ``ClientJob.epoch_steps``), the model's buffers are BatchNorm's running statistics (kept per
client, stacked like the weights and updated by each client's own rows; a step whose
clients' batches differ in size runs as one batched step per run of clients with batches of
one size, since padding rows would enter the batch statistics) or none, its dropout, if any, is keyed
(``fedforget.dropout``: each client's masks drawn from its own key, as alone; torch's
dropout is refused), and the optimizer is SGD or Adam. Otherwise it falls back to one
client after another; ``run.json`` records which path ran.

Memory: the stack holds (weights + momentum + gradient) for the clients of one group; the
engine splits a round's clients into groups of at most ``train.max_parallel_clients``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from .cudagraph import StepGraphs
from .dropout import (
    DropoutKey,
    KeyedDropout,
    keep_scale,
    key_tensor,
    keyed_modules,
    scaled_mask,
    set_dropout_key,
)
from .inputs import prefetched
from .methods.base import (
    Held,
    JoinedLive,
    LiveStep,
    LiveTerms,
    PlannedTerms,
    ReplyGrads,
    StepBatch,
    StepTerms,
    masked_logits,
)
from .models import (
    BasicBlock,
    Classifier,
    HFBody,
    LocalitySelfAttention,
    Resize,
    ResNetBody,
    SelfAttention,
    SLViTBody,
    TaskHeads,
    ViTBody,
    normalises_by_batch,
    pool_tokens,
)
from .utils import FedForgetError


def method_not_vectorized(
    method_cls: type, optimizer_name: str, drop_last: bool = False, params: object = None
) -> str | None:
    """The part of ``why_not_vectorized`` that depends on the method (configured with
    ``params``: a plug-in stacks only over a stacked base) and its train settings alone (the
    same for every model): None, or why its clients cannot train together."""
    if not method_cls.trait("stacked", params):
        if method_cls.stacks_with_base and params is not None:
            return f"method '{method_cls.name}' over '{params.base}', whose local step is its own"
        return f"method '{method_cls.name}' has a local step of its own (declares stacked = False)"
    if optimizer_name not in ("sgd", "adam"):
        return f"optimizer '{optimizer_name}' (the batched path implements SGD and Adam)"
    return None


def frozen_encoders(model: nn.Module) -> list[tuple[str, HFBody]]:
    """``model``'s frozen Hugging Face encoders (``HFBody.frozen``) with their names: one map
    for every client, in eval mode whatever the model's mode (its dropout never draws)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, HFBody) and m.frozen]


def frozen_tensors(model: nn.Module) -> set[str]:
    """The state-dict names of ``model``'s frozen encoders' parameters and buffers: tensors
    no client changes (no gradient, eval mode), the same global tensors round after round."""
    return {f"{name}.{k}" if name else k for name, m in frozen_encoders(model) for k in m.state_dict()}


def fixed_buffers(model: nn.Module) -> set[str]:
    """The buffers of ``model``'s Hugging Face encoders, frozen or training (constants such
    as BERT's position and token type ids, the same for every client): not stacked, not per
    client."""
    encoders = [(name, m) for name, m in model.named_modules() if isinstance(m, HFBody)]
    return {f"{name}.{b}" if name else b for name, m in encoders for b, _ in m.named_buffers()}


def training_encoder(model: nn.Module) -> HFBody | None:
    """``model``'s training Hugging Face encoder (``HFBody`` not frozen), if any."""
    return next((m for m in model.modules() if isinstance(m, HFBody) and not m.frozen), None)


def unstacked_buffers(model: nn.Module) -> str | None:
    """None if every buffer of ``model`` is one the stacked path keeps per client (BatchNorm's
    running statistics with an exponential ``momentum``) or a frozen encoder's constant
    (``fixed_buffers``), else why not."""
    owners = {n for n, _ in model.named_buffers()} - fixed_buffers(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            if m.momentum is None:
                return f"BatchNorm {name or 'module'} with momentum=None (a cumulative average: not batched)"
            owners -= {f"{name}.{b}" if name else b for b, _ in m.named_buffers(recurse=False)}
    if owners:
        return f"the model has buffers other than BatchNorm's running statistics ({sorted(owners)[0]})"
    return None


def why_not_vectorized(
    method_cls: type, model: nn.Module, optimizer_name: str, drop_last: bool = False, params: object = None
) -> str | None:
    """None if clients can be trained together, else the reason (recorded in run.json)."""
    encoder = training_encoder(model)
    if encoder is not None and (bad := stacked_supported(model)) is not None:
        return (f"a training Hugging Face encoder the batched path cannot run (module {bad}): one "
                "client after another, or several at once on lanes (train.concurrent_clients)")  # fmt: skip
    bad = unstacked_buffers(model)
    if bad is not None:
        return bad
    if isinstance(getattr(model, "head", None), TaskHeads):  # [D] the active head trains in the stack;
        # replayed rows (sees_step) are routed to their task's head there (StepBatch.forward)
        if method_cls.trait("live_terms", params) and method_cls.trait("stacked", params) \
                and not method_cls.trait("live_heads", params):
            return (f"per-task heads with method '{method_cls.name}''s terms of the step's own forward pass "
                    "(live_terms: written for one head, not routed per task in the batched path)")  # fmt: skip
    inert = {id(x) for _, m in frozen_encoders(model) for x in m.modules()}  # its dropout never draws,
    if encoder is not None:  # and a training one's calls are keyed (HFBody.draws; stacked_supported)
        inert |= {id(x) for x in encoder.modules()}
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and id(m) not in inert for m in model.modules()):
        return (
            "the model has torch's dropout (its draws would differ from one client alone; "
            "fedforget.dropout.KeyedDropout draws the same in both trainers)"
        )
    if method_cls.trait("live_terms", params) and method_cls.trait("stacked", params):
        bad = stacked_supported(model)
        if bad is not None:  # [D] its second pass or logit loss is written for stacked_forward
            return (
                f"method '{method_cls.name}' has terms of the step's own forward pass (live_terms); the "
                f"batched path runs them where it runs the model layer by layer (module {bad})"
            )
    if method_cls.trait("sees_step", params) and method_cls.trait("stacked", params):
        # replayed rows: keyed dropout draws them as alone (the step's second forward call,
        # padding rows after the real ones) where stacked_forward runs the model; [D] not
        # under vmap (its key per client inside the mapped function is not passed there)
        if keyed_modules(model) and stacked_supported(model) is not None:
            return (
                f"method '{method_cls.name}' replays rows through the model each step; the batched "
                "path does so with keyed dropout where it runs the model layer by layer (stacked_forward)"
            )
    return method_not_vectorized(method_cls, optimizer_name, drop_last, params)


# positions -> (x, y, logit mask or None) of the engine's training rows (the trainer's masked_batch: ClientData.batch with FedAvg.task_mask)
Batcher = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


@dataclass
class ClientJob:
    cid: int
    start: int  # the client's rows are positions start:start+n of the engine's data (ClientData)
    n: int
    generator: torch.Generator  # the client's shuffling generator, keyed as in train_client
    # per local epoch, what its steps add to their positions (ClientData.draw_offset: the
    # rows' augmentation key); empty: nothing
    draw_offsets: Sequence[int] = ()
    dropout_key: int = 0  # the client's dropout key of the round (fedforget.dropout.client_key)
    # at most this many minibatches per local epoch (ClientContext.epoch_steps: a method that
    # cuts epochs, TARGET's code rule), the first of each epoch's order; None: every one
    epoch_steps: int | None = None


@dataclass
class ClientResult:
    cid: int
    params: dict[str, torch.Tensor]  # state dict after local training
    mean_loss: float  # mean minibatch loss over its steps
    steps: int


LOOP_MIN_ROWS = 16  # see train_clients_together: Conv2d models on a CPU
SCOPED_MIN_USES = 3  # see train_clients_together: a step shape captured for one call only
ELEMENTWISE = {nn.ReLU: F.relu, nn.Tanh: torch.tanh, nn.Sigmoid: torch.sigmoid, nn.Identity: lambda h: h}
POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)


def _torchvision_block(module: nn.Module) -> bool:
    """``module`` is torchvision's ResNet BasicBlock (the ``resnet18_imagenet`` model's; an
    instance exists only once torchvision's resnet module is imported, so this imports nothing)."""
    tv = sys.modules.get("torchvision.models.resnet")
    return tv is not None and type(module) is tv.BasicBlock


def stacked_supported(module: nn.Module) -> str | None:
    """None if ``stacked_forward`` can run ``module``, else the first module it cannot."""
    if isinstance(module, (Classifier, nn.Sequential, TaskHeads)):
        for child in (module.heads if isinstance(module, TaskHeads) else module.children()):
            bad = stacked_supported(child)
            if bad is not None:
                return bad
        return None
    if callable(getattr(module, "stacked_body", None)):  # a module that runs itself stacked (L2P's
        return module.stacked_unsupported()  # PromptedViT: a frozen map with per-client prompts)
    if type(module) is ResNetBody:  # its forward, written out in _stacked
        parts = [module.conv1, module.bn1, module.pool, *(b for stage in module.stages for b in stage)]
        return next((bad for c in parts if (bad := stacked_supported(c)) is not None), None)
    if type(module) is BasicBlock or _torchvision_block(module):
        return next((bad for c in module.children() if (bad := stacked_supported(c)) is not None), None)
    if type(module) is SLViTBody:  # its forward, written out in _stacked_slvit
        parts = [module.tokens.norm, module.tokens.proj, module.norm, *(m for block in module.blocks for m in block)]
        return next((bad for c in parts if (bad := stacked_supported(c)) is not None), None)
    if type(module) is ViTBody:  # its forward, written out in _stacked_vit
        vit = module.vit
        parts = [vit.conv_proj, vit.encoder.dropout, vit.encoder.ln, *(m for blk in vit.encoder.layers
                 for m in (blk.ln_1, blk.self_attention, blk.dropout, blk.ln_2, blk.mlp))]  # fmt: skip
        return next((bad for c in parts if (bad := stacked_supported(c)) is not None), None)
    if type(module) is SelfAttention:
        return None if module.dropout == 0 else "SelfAttention(dropout > 0)"
    if type(module) is nn.Dropout:  # torchvision's ViT holds them at p = 0: the identity
        return None if module.p == 0 else "Dropout(p > 0)"
    if type(module) is LocalitySelfAttention:
        return next((bad for c in (module.qkv, module.out) if (bad := stacked_supported(c)) is not None), None)
    if isinstance(module, HFBody):  # frozen: one feature map for every client; training: a BERT (_stacked)
        return None if module.frozen else _hf_unsupported(module)
    if type(module) in (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm):
        return None
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and module.padding_mode == "zeros":
        return None
    if isinstance(module, nn.GELU) and module.approximate == "none":
        return None
    if isinstance(module, nn.Flatten) and module.start_dim == 1 and module.end_dim == -1:
        return None
    if isinstance(module, KeyedDropout):
        return None
    if isinstance(module, nn.MaxPool1d | nn.MaxPool2d) and module.return_indices:
        return type(module).__name__ + "(return_indices=True)"
    if type(module) in ELEMENTWISE or isinstance(module, (nn.Linear, Resize, *POOLS)):
        return None
    return type(module).__name__


def _hf_unsupported(body: HFBody) -> str | None:
    """None if ``_stacked_hf`` runs the training encoder of ``body``, else why not: [D] it
    writes out transformers' ``BertModel`` as an encoder (TinyBERT, MiniLM: FedProj Table
    2's), whose dropout is all keyed (``HFBody.global_draws`` false)."""
    enc = body.encoder
    bert = sys.modules.get("transformers.models.bert.modeling_bert")  # imported where a BERT was built
    if bert is None or type(enc) is not bert.BertModel:
        return f"HFBody({type(enc).__name__}; a training encoder is written out for BertModel only)"
    if enc.config.is_decoder or enc.config.add_cross_attention:
        return "HFBody(BertModel as a decoder)"
    positions = getattr(enc.config, "position_embedding_type", "absolute")  # (transformers 4 has others)
    if positions != "absolute":
        return f"HFBody(BertModel with position_embedding_type={positions!r}; absolute is written out)"
    if body.global_draws:
        return "HFBody(draws from the global random generator)"
    return None


def no_graphs(model: nn.Module) -> str | None:
    """Why ``model``'s batched steps run eagerly on a GPU whatever the method (None: they may
    run in CUDA graphs): [D] a Hugging Face encoder: a frozen one's feature cache
    (fedforget.featcache) looks its rows up on the host at every step, and a training one's
    dropout masks come from generators seeded on the host (``KeyedCalls.draw_stack``)."""
    if any(isinstance(m, HFBody) for m in model.modules()):
        return "a Hugging Face encoder (a frozen one's feature cache looks rows up on the host; a training one's masks are seeded there)"
    return None


# the ResNets' modules (auto_prefers_sequential)
NORMED = (ResNetBody, BasicBlock, nn.BatchNorm2d, nn.GroupNorm)


def stacked_forward(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits [G, B, classes] of G weight sets of ``module``'s architecture, each on its own
    inputs: ``params`` maps ``module``'s parameter names to stacked tensors [G, ...], ``x``
    is [G, B, ...]. Only for modules ``stacked_supported`` accepts."""
    g = x.shape[0]
    h, layout = _stacked(module, params, x, g, "", GB)
    return _relayout(h, layout, GB, g)


def stacked_head(model: Classifier, params: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """The head of ``model`` on stacked body features [G, B, F] (``stacked_features``):
    logits [G, B, classes], as ``stacked_forward`` computes them after the body."""
    return _relayout(*_stacked(model.head, params, features, features.shape[0], "head.", GB), GB, features.shape[0])


def stacked_features(
    model: Classifier, params: dict[str, torch.Tensor], x: torch.Tensor, levels: list | None = None
) -> torch.Tensor:
    """The body features [G, B, F] of G weight sets of ``model`` (a ``Classifier``), each on
    its own inputs [G, B, ...]: ``stacked_forward``'s first half. ``levels``: a list that a
    ResNet body fills with its ``forward_levels`` representations, each [G, B, d_l]."""
    g = x.shape[0]
    h, layout = _stacked(model.body, params, x, g, "body.", GB, levels)
    if levels:
        levels[:] = [_relayout(v, GRP, GB, g) for v in levels]
    return _relayout(h, layout, GB, g)


def loops_wide_steps(model: nn.Module, device: torch.device) -> bool:
    """Whether stacks of at least ``LOOP_MIN_ROWS`` rows of ``model`` run client by client
    on ``device``: a model with a training Conv2d on a CPU (``train_clients_together``
    says why; ``reply_grads`` follows it)."""
    return device.type != "cuda" and any(
        isinstance(m, nn.Conv2d) and any(q.requires_grad for q in m.parameters()) for m in model.modules()
    )


def stacked_replies_refused(model: nn.Module) -> str | None:
    """Why the clients' replies of a method's ``stacked_replies`` run client by client on
    this model (``LocalTrainer.client_pass``), or None where ``reply_grads`` runs them a stack
    at a time: [D] a reply's pass routes no row through per-task heads (``row_logits``) and
    runs no Hugging Face encoder or module that runs itself; everything else
    ``stacked_forward`` runs, keyed dropout included (each client's reply key)."""
    if isinstance(getattr(model, "head", None), TaskHeads):
        return "per-task heads (each replayed row through its own task's head)"
    if any(isinstance(m, HFBody) or callable(getattr(m, "stacked_body", None)) for m in model.modules()):
        return "a Hugging Face encoder or a module that runs itself stacked"
    return stacked_supported(model)


def reply_grads(model: nn.Module, global_params: dict[str, torch.Tensor], keys: Sequence[int]) -> ReplyGrads:
    """``methods.base.ReplyGrads`` of a stack of clients at the global weights
    ``global_params`` (``model``'s architecture; ``stacked_replies_refused`` None): each
    client's own copy of the weights [G, ...], its logits by ``stacked_forward`` in training
    mode (each client's BatchNorm batch statistics over its own rows; the running statistics
    move in copies of the global ones, then are dropped, as the trainer's reload drops a
    client alone's), the gradient of the sum of the clients' losses in the copies (each
    client's own). On a CPU a Conv2d model's stacks of at least ``LOOP_MIN_ROWS`` rows run
    client by client, as its training steps do (``train_clients_together``): each client's
    forward (``functional_call`` on the global tensors, no copy) and backward on its own. The
    same gradients as alone up to float summation order. ``keys``: the
    dropout keys of the clients of ``client_replies``' contexts (``dropout.reply_key``), the
    pass's clients picked by ``at``: each draws its masks as it does replying alone."""
    names = [n for n, q in model.named_parameters() if q.requires_grad]
    frozen = [n for n, q in model.named_parameters() if not q.requires_grad]
    fixed = fixed_buffers(model)
    buffer_names = [n for n, _ in model.named_buffers() if n not in fixed]
    device = next(iter(global_params.values())).device
    loop_wide = loops_wide_steps(model, device)
    drop = keyed_modules(model)

    def grads(
        x: torch.Tensor, task: torch.Tensor | None, loss_of: Callable[[torch.Tensor, int], torch.Tensor],
        at: Sequence[int],
    ) -> dict:  # fmt: skip
        g, hosts = x.shape[0], [keys[i] for i in at]
        model.train()
        try:
            if loop_wide and x.shape[1] >= LOOP_MIN_ROWS:  # client by client, each its own backward
                out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
                for j in range(g):
                    if drop:
                        set_dropout_key(drop, DropoutKey(key_tensor(hosts[j], device), 0, hosts[j]))
                    leaves = {n: global_params[n].detach().requires_grad_() for n in names}  # no copy
                    bufs = {n: global_params[n].clone() for n in buffer_names}
                    logits = functional_call(model, {**global_params, **leaves, **bufs}, (x[j],))
                    (loss,) = loss_of(logits.unsqueeze(0), j)
                    gs = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
                    for (n, v), d in zip(leaves.items(), gs):
                        out[n].append(torch.zeros_like(v) if d is None else d)
                return {n: torch.stack(v) for n, v in out.items()}
            copies = {n: global_params[n].detach().unsqueeze(0).repeat(g, *[1] * global_params[n].dim())
                      for n in [*names, *frozen, *buffer_names]}  # fmt: skip
            w = {n: copies[n].requires_grad_() for n in names}
            if drop:
                set_dropout_key(drop, DropoutKey(key_tensor(hosts, device), 0))
            logits = stacked_forward(model, copies, x)
            gs = torch.autograd.grad(loss_of(logits, 0).sum(), list(w.values()), allow_unused=True)
            return {n: torch.zeros_like(v) if d is None else d for (n, v), d in zip(w.items(), gs)}
        finally:
            set_dropout_key(drop, None)

    return grads


# [D] On a GPU the ResNets' stacked layers run in channels_last (NHWC) memory format: the same
# arithmetic, other kernels. cuDNN's grouped NCHW convolutions spent their time in a slow
# backward kernel and in NCHW<->NHWC transposes (profile-resnet18-vectorized.txt); issue 32's
# ResNet-18 setting ran 0.76x the plain loop batched in NCHW, 1.72x in NHWC (H200,
# benchmarks/results/h200-2026-11-27-c and its run2/). FEDFORGET_STACKED_CHANNELS_LAST: 1 every
# stacked Conv2d model (unmeasured for the others), 0 none, unset (or resnet) the ResNets
CHANNELS_LAST_MODES = ("0", "1", "resnet")


def channels_last_mode(value: str | None) -> str:
    """FEDFORGET_STACKED_CHANNELS_LAST's mode (unset: resnet); any other value refused, named."""
    mode = "resnet" if value is None else value
    if mode not in CHANNELS_LAST_MODES:
        raise FedForgetError(f"FEDFORGET_STACKED_CHANNELS_LAST={value!r}; allowed: {', '.join(CHANNELS_LAST_MODES)} (unset: resnet)")
    return mode


CHANNELS_LAST = channels_last_mode(os.environ.get("FEDFORGET_STACKED_CHANNELS_LAST"))


def nhwc_device(t: torch.Tensor) -> bool:
    """Whether the stacked layers on ``t`` may run in channels_last: on a GPU [D] (the tests
    run the same code on a CPU by replacing this)."""
    return t.is_cuda

# activation layouts of stacked_forward
GB = "[G, B, ...]"  # client, sample, features: Linear layers (one batched matmul)
GRP = "[B, G*C, ...]"  # clients side by side in the channels: convolutions (one grouped conv), pooling


def _relayout(h: torch.Tensor, frm: str, to: str, g: int) -> torch.Tensor:
    if frm == to:
        return h
    if frm == GRP:  # [B, G*C, ...] -> [G, B, C, ...] (a view)
        return h.view(h.shape[0], g, -1, *h.shape[2:]).transpose(0, 1)
    return h.transpose(0, 1).reshape(h.shape[1], g * h.shape[2], *h.shape[3:])  # one copy


def _stacked(
    module: nn.Module, p: dict[str, torch.Tensor], h: torch.Tensor, g: int, prefix: str, layout: str,
    levels: list | None = None,
):  # fmt: skip
    if isinstance(module, Classifier):  # Classifier.forward: head(body(x))
        h, layout = _stacked(module.body, p, h, g, prefix + "body.", layout)
        return _stacked(module.head, p, h, g, prefix + "head.", layout)
    if isinstance(module, HFBody) and not module.frozen:  # a BERT, each client's weights (_hf_unsupported)
        return _stacked_hf(module, p, _relayout(h, layout, GB, g), g, prefix), GB
    if isinstance(module, HFBody):  # [D] frozen (stacked_supported): the same map for every client, so
        # the module itself over all clients' rows at once (its features kept per row: featcache)
        h = _relayout(h, layout, GB, g)
        f = module(h.reshape(-1, *h.shape[2:]))
        return f.view(g, -1, *f.shape[1:]), GB
    if callable(getattr(module, "stacked_body", None)):  # it runs itself: features [G, B, ...]
        return module.stacked_body(p, _relayout(h, layout, GB, g), prefix), GB
    if isinstance(module, nn.Sequential):
        for name, child in module.named_children():
            h, layout = _stacked(child, p, h, g, f"{prefix}{name}.", layout)
        return h, layout
    if isinstance(module, TaskHeads):  # TaskHeads.forward: the active task's head
        return _stacked(module.heads[module.active], p, h, g, f"{prefix}heads.{module.active}.", layout)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):  # one grouped convolution for all clients
        h = _relayout(h, layout, GRP, g)
        w, b = p[prefix + "weight"], p.get(prefix + "bias")
        conv = F.conv2d if isinstance(module, nn.Conv2d) else F.conv1d
        bias = None if b is None else b.reshape(-1)
        w = w.reshape(-1, *w.shape[2:])  # [G*O, C/groups, k...]
        if h.dim() == 4 and nhwc_device(h) and (CHANNELS_LAST == "1" or _nhwc(h)):  # what follows keeps it
            h = h.contiguous(memory_format=torch.channels_last)
            w = w.contiguous(memory_format=torch.channels_last)
        return conv(h, w, bias, module.stride, module.padding, module.dilation, g * module.groups), GRP
    if type(module) is ResNetBody:  # ResNetBody.forward: stem, blocks (each then ReLU), average pool
        h = _relayout(h, layout, GRP, g)
        if nhwc_device(h) and CHANNELS_LAST != "0":  # its layers follow the input's layout
            h = h.contiguous(memory_format=torch.channels_last)
        for name in ("conv1", "bn1"):
            h = _stacked(getattr(module, name), p, h, g, f"{prefix}{name}.", GRP)[0]
        if levels is not None:  # forward_levels: the stem and each stage before its ReLU, pooled
            levels.append(h.mean(dim=(2, 3)))
        h = _stacked(module.pool, p, F.relu(h), g, prefix + "pool.", GRP)[0]
        for i, stage in enumerate(module.stages):
            for j, block in enumerate(stage):
                h = _stacked(block, p, h, g, f"{prefix}stages.{i}.{j}.", GRP)[0]
                if levels is not None and j == len(stage) - 1:
                    levels.append(h.mean(dim=(2, 3)))
                h = F.relu(h)
        return h.mean(dim=(2, 3)), GRP  # [B, G*C]: each client's channels pooled alone
    if type(module) is BasicBlock or _torchvision_block(module):
        # ours (BasicBlock.forward): the sum before the final ReLU, which ResNetBody applies;
        # torchvision's (resnet18_imagenet): its ReLU included, and on a GPU in channels_last
        # from its first block on, as ResNetBody's blocks run
        ours = type(module) is BasicBlock
        x = _relayout(h, layout, GRP, g)
        if not ours and nhwc_device(x) and CHANNELS_LAST != "0":
            x = x.contiguous(memory_format=torch.channels_last)

        def run(name: str, x: torch.Tensor) -> torch.Tensor:
            return _stacked(getattr(module, name), p, x, g, f"{prefix}{name}.", GRP)[0]

        out = run("bn2", run("conv2", F.relu(run("bn1", run("conv1", x)))))
        if ours:
            return out + run("shortcut", x), GRP
        return F.relu(out + (x if module.downsample is None else run("downsample", x))), GRP
    if type(module) is SLViTBody:
        return _stacked_slvit(module, p, _relayout(h, layout, GB, g), g, prefix), GB
    if type(module) is ViTBody:
        return _stacked_vit(module, p, _relayout(h, layout, GB, g), g, prefix), GB
    if type(module) is nn.Dropout:  # p = 0 (stacked_supported)
        return h, layout
    if type(module) is nn.LayerNorm:  # over each row's last dimensions, each client's affine
        h = _relayout(h, layout, GB, g)
        out = F.layer_norm(h, module.normalized_shape, None, None, module.eps)
        shape = (g, *[1] * (h.dim() - 1 - len(module.normalized_shape)), *module.normalized_shape)
        w, b = p.get(prefix + "weight"), p.get(prefix + "bias")
        out = out if w is None else out * w.view(shape)
        return (out if b is None else out + b.view(shape)), GB
    if type(module) is nn.BatchNorm2d:  # one per channel: a client's channels are its own
        return _stacked_batchnorm(module, p, _relayout(h, layout, GRP, g), prefix), GRP
    if type(module) is nn.GroupNorm:  # a client's groups are whole groups of the stack's channels
        w, b = p.get(prefix + "weight"), p.get(prefix + "bias")
        h = _relayout(h, layout, GRP, g)
        flat = (None if w is None else w.reshape(-1), None if b is None else b.reshape(-1))
        return F.group_norm(h, g * module.num_groups, *flat, module.eps), GRP
    if isinstance(module, (Resize, *POOLS)):  # acts per channel: GRP is the [N, C, ...] it expects
        return module(_relayout(h, layout, GRP, g)), GRP
    if isinstance(module, nn.Flatten):
        return _relayout(h, layout, GB, g).flatten(2), GB
    if isinstance(module, nn.Linear):
        h = _relayout(h, layout, GB, g)
        lead = h.shape[:-1]  # [G, B, ...]: nn.Linear acts on the last dimension
        h = h.reshape(g, -1, h.shape[-1])
        w, b = p[prefix + "weight"], p.get(prefix + "bias")
        out = torch.bmm(h, w.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
        return out.view(*lead, -1), GB
    if isinstance(module, nn.GELU):
        return F.gelu(h), layout
    if isinstance(module, KeyedDropout):
        return _stacked_dropout(module, h, layout, g), layout
    return ELEMENTWISE[type(module)](h), layout


def _stacked_slvit(module: SLViTBody, p: dict[str, torch.Tensor], x: torch.Tensor, g: int, prefix: str) -> torch.Tensor:
    """``SLViTBody.forward`` of G clients on their images [G, B, C, H, W] (GB): the shifted
    patches of all rows at once (no weights), then each client's LayerNorms, linear maps
    (batched matmuls), class token, position embedding and attention (its temperature per
    client); the class token's representation [G, B, dim]."""
    b = x.shape[1]
    if x.shape[2] == 1:
        x = x.expand(-1, -1, 3, -1, -1)

    def run(mod: nn.Module, name: str, h: torch.Tensor) -> torch.Tensor:
        return _stacked(mod, p, h, g, prefix + name, GB)[0]

    t = module.tokens.patches(x.flatten(0, 1))
    t = run(module.tokens.proj, "tokens.proj.", run(module.tokens.norm, "tokens.norm.", t.view(g, b, *t.shape[1:])))
    cls = p[prefix + "cls"].expand(-1, b, -1, -1)  # [G, 1, 1, dim] -> [G, B, 1, dim]
    t = torch.cat([cls, t], dim=2) + p[prefix + "pos"]  # [G, 1, N, dim]: each client's, over its rows
    n = t.shape[2]
    for i, (norm1, attn, norm2, mlp) in enumerate(module.blocks):
        at = f"blocks.{i}."
        qkv = run(attn.qkv, at + "1.qkv.", run(norm1, at + "0.", t))  # [G, B, N, 3 * heads * d]
        q, k, v = qkv.reshape(g, b, n, 3, attn.heads, -1).permute(3, 0, 1, 4, 2, 5)  # each [G, B, H, N, d]
        scale = p[prefix + at + "1.temperature"].exp().view(g, 1, 1, 1, 1)
        o = LocalitySelfAttention.attend(q, k, v, scale).transpose(2, 3).reshape(g, b, n, -1)
        t = run(attn.out, at + "1.out.", o) + t
        t = run(mlp, at + "3.", run(norm2, at + "2.", t)) + t
    return run(module.norm, "norm.", t[:, :, 0])


def _stacked_vit(module: ViTBody, p: dict[str, torch.Tensor], x: torch.Tensor, g: int, prefix: str) -> torch.Tensor:
    """``ViTBody.forward`` (torchvision's ``VisionTransformer`` without its head) of G
    clients on their images [G, B, C, H, W] (GB): the resize and channel repeat of all rows
    at once (no weights), each client's patch embedding (one grouped convolution), class
    token, position embedding, LayerNorms, attention projections and MLPs (batched matmuls)
    and attention (``SelfAttention``'s ops over the stack's rows); the class token's final
    representation [G, B, hidden]. Dropout is p = 0 throughout (``stacked_supported``)."""
    vit, b = module.vit, x.shape[1]

    def run(mod: nn.Module, name: str, h: torch.Tensor, layout: str = GB) -> torch.Tensor:
        return _stacked(mod, p, h, g, prefix + name, layout)[0]

    px = module.pixels(x.flatten(0, 1))  # [G * B, 3, S, S]
    t = _stacked(vit.conv_proj, p, px.view(g, b, *px.shape[1:]), g, prefix + "vit.conv_proj.", GB)[0]  # [B, G * hidden, n_h, n_w]
    t = t.reshape(b, g, vit.hidden_dim, -1).permute(1, 0, 3, 2)  # [G, B, N, hidden]: _process_input's order
    cls = p[prefix + "vit.class_token"].expand(-1, b, -1, -1)  # [G, 1, 1, hidden] -> [G, B, 1, hidden]
    t = torch.cat([cls, t], dim=2) + p[prefix + "vit.encoder.pos_embedding"]  # each client's, over its rows
    n = t.shape[2]
    for name, blk in vit.encoder.layers.named_children():
        at = f"vit.encoder.layers.{name}."
        attn = blk.self_attention
        h, d = attn.num_heads, attn.embed_dim // attn.num_heads
        qkv = run(attn.in_proj, at + "self_attention.in_proj.", run(blk.ln_1, at + "ln_1.", t))  # [G, B, N, 3E]
        q, k, v = qkv.view(g * b, n, 3, h, d).permute(2, 0, 3, 1, 4)  # each [G * B, H, N, d]
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(g, b, n, -1)
        t = run(attn.out_proj, at + "self_attention.out_proj.", o) + t
        t = run(blk.mlp, at + "mlp.", run(blk.ln_2, at + "ln_2.", t)) + t
    return run(vit.encoder.ln, "vit.encoder.ln.", t[:, :, 0])


class _KeptAttention(torch.autograd.Function):
    """``(softmax(scores) * keep * scale) @ v``: ``_stacked_hf``'s attention with dropout
    (``keep`` bool, ``scale`` 1/(1 - p)), the same forward kernels as the operators written
    out, keeping for the backward the probabilities, the keep mask and v only [D]: autograd
    would keep the probabilities, the float mask and their product, three tensors of the
    scores' size ([G, B, heads, L, L], the stack's largest) per layer against one and a
    quarter. Its backward is autograd's (matmul's two products, the mask, softmax's own
    backward)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, keep: torch.Tensor, scale: float, v: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(-1)
        ctx.save_for_backward(probs, keep, v)
        ctx.scale = scale
        return probs.mul(keep).mul_(scale) @ v  # (p * 1) * s: the bits of p * (1 * s), and 0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, keep, v = ctx.saved_tensors
        g_probs = (grad @ v.transpose(-2, -1)).mul_(keep).mul_(ctx.scale)
        g_v = probs.mul(keep).mul_(ctx.scale).transpose(-2, -1) @ grad
        return torch._softmax_backward_data(g_probs, probs, -1, probs.dtype), None, None, g_v


def _stacked_hf(body: HFBody, p: dict[str, torch.Tensor], x: torch.Tensor, g: int, prefix: str) -> torch.Tensor:
    """``HFBody.features`` of a training ``BertModel`` (transformers' BertEmbeddings,
    BertLayer, BertPooler) for G clients on their rows [G, B, 2, L] (token ids, attention
    mask): each client's embedding tables (one lookup into the G tables side by side; the
    padding token's row gets no gradient, as ``nn.Embedding``'s ``padding_idx``),
    LayerNorms, linear maps (batched matmuls) and attention over its own rows; the pooled
    features [G, B, hidden] (``pool_tokens`` or the pooler). Attention is softmax(q k^T
    scale + mask) v, the mask additive (the dtype's minimum on masked keys, as BERT's eager
    attention; a padding row of the stack, every key masked, stays finite): written out
    where dropout draws (``_KeptAttention``), else torch's fused attention. Dropout in
    training: each call's masks those each client draws alone (``KeyedCalls.draw_stack``:
    its host key, the step, the call's salt, over its real rows), the calls in the order of
    the module's own forward (embeddings; per layer attention probabilities, attention
    output, output), a call at rate 0 not counted, as ``KeyedCalls.routed`` counts them."""
    enc, b, n = body.encoder, x.shape[1], x.shape[3]
    pre = prefix + "encoder."
    ids, am = x[:, :, 0], x[:, :, 1]  # [G, B, L]
    calls = body.draws

    def drop(h: torch.Tensor, rate: float) -> torch.Tensor:
        if not body.training or rate == 0:
            return h
        return h * scaled_mask(calls.draw_stack(h.shape, rate), rate, h.dtype)  # in h's dtype, as alone

    def run(mod: nn.Module, name: str, h: torch.Tensor) -> torch.Tensor:
        return _stacked(mod, p, h, g, pre + name, GB)[0]

    emb = enc.embeddings
    words = p[pre + "embeddings.word_embeddings.weight"]  # [G, V, d]
    v = words.shape[1]
    h = F.embedding(ids + v * torch.arange(g, device=ids.device).view(g, 1, 1), words.reshape(g * v, -1))
    if emb.word_embeddings.padding_idx is not None:
        h = torch.where((ids == emb.word_embeddings.padding_idx).unsqueeze(-1), h.detach(), h)
    h = h + p[pre + "embeddings.token_type_embeddings.weight"][:, emb.token_type_ids[0, :n]].unsqueeze(1)
    h = h + p[pre + "embeddings.position_embeddings.weight"][:, emb.position_ids[0, :n]].unsqueeze(1)
    h = drop(run(emb.LayerNorm, "embeddings.LayerNorm.", h), emb.dropout.p)  # [G, B, L, d]

    def additive(dtype: torch.dtype) -> torch.Tensor:  # [G, B, 1, 1, L]: over every head's and query's keys
        return ((1.0 - am.to(dtype)) * torch.finfo(dtype).min).view(g, b, 1, 1, n)

    masked = additive(h.dtype)
    for i, layer in enumerate(enc.encoder.layer):
        at, sa = f"encoder.layer.{i}.", layer.attention.self
        heads = sa.num_attention_heads
        scaling = getattr(sa, "scaling", sa.attention_head_size**-0.5)  # (transformers 4: 1 / sqrt(d) in its forward)

        q, k, val = (run(getattr(sa, name), f"{at}attention.self.{name}.", h).view(g, b, n, heads, -1).transpose(2, 3)
                     for name in ("query", "key", "value"))  # each [G, B, H, L, d]  # fmt: skip
        rate = sa.dropout.p
        if body.training and rate > 0:  # keyed masks: attention by its definition, as KeyedCalls.routed
            scores = q @ k.transpose(-2, -1)
            if not torch.is_autocast_enabled(scores.device.type):  # in place: the stack's largest tensors
                scores = scores.mul_(scaling).add_(masked)
                att = _KeptAttention.apply(scores, calls.draw_stack(scores.shape, rate), keep_scale(rate), val)
            else:  # autocast: autograd's own casts, the float32 mask promoting the scores
                att = drop((scores * scaling + masked).softmax(-1), rate) @ val
        else:  # [D] no draw (eval mode, or rate 0): torch's fused attention, as the module's own sdpa
            # attention (no [.., L, L] scores kept where its kernel fuses them: a GPU's)
            mask = masked if masked.dtype == q.dtype else additive(q.dtype)
            att = F.scaled_dot_product_attention(q.flatten(0, 1), k.flatten(0, 1), val.flatten(0, 1),
                                                 attn_mask=mask.flatten(0, 1), scale=scaling).view(q.shape)  # fmt: skip
        ctx = att.transpose(2, 3).reshape(g, b, n, -1)
        out = layer.attention.output
        a = drop(run(out.dense, at + "attention.output.dense.", ctx), out.dropout.p)
        a = run(out.LayerNorm, at + "attention.output.LayerNorm.", a + h)
        inner = layer.intermediate.intermediate_act_fn(run(layer.intermediate.dense, at + "intermediate.dense.", a))
        o = drop(run(layer.output.dense, at + "output.dense.", inner), layer.output.dropout.p)
        h = run(layer.output.LayerNorm, at + "output.LayerNorm.", o + a)
    if body.pooling == "pooler":  # BertPooler: dense and tanh on the first token
        return torch.tanh(run(enc.pooler.dense, "pooler.dense.", h[:, :, 0]))
    return pool_tokens(h.flatten(0, 1), am.flatten(0, 1), body.pooling).view(g, b, -1)


def _nhwc(h: torch.Tensor) -> bool:
    """``h`` [N, C, H, W] is laid out channels_last, and not also NCHW (C = 1 or H = W = 1)."""
    return h.is_contiguous(memory_format=torch.channels_last) and not h.is_contiguous()


def _stacked_batchnorm(module: nn.BatchNorm2d, p: dict[str, torch.Tensor], h: torch.Tensor, prefix: str) -> torch.Tensor:
    """``module`` (nn.BatchNorm2d.forward) on the G clients' activations [B, G*C, ...]: its
    weights and running statistics from ``p`` ([G, C] each, contiguous, so that [G*C] is a
    view), the statistics updated in place in training mode, each client's by its own rows
    (the batch statistics of a channel are over B and the spatial positions, as alone)."""

    def flat(name: str) -> torch.Tensor | None:
        t = p.get(prefix + name)
        return None if t is None else t.reshape(-1)

    mean, var = flat("running_mean"), flat("running_var")
    if module.track_running_stats and mean is None:
        raise ValueError(f"stacked BatchNorm {prefix!r} without its running statistics (pass the stacked buffers)")
    factor = 0.0
    if module.training and module.track_running_stats:
        if module.momentum is None:  # unstacked_buffers refuses it for training
            raise ValueError(f"stacked BatchNorm {prefix!r} with momentum=None")
        p[prefix + "num_batches_tracked"].add_(1)
        factor = module.momentum
    use_batch = module.training or mean is None
    return F.batch_norm(h, mean, var, flat("weight"), flat("bias"), use_batch, factor, module.eps)


def _stacked_dropout(module: KeyedDropout, h: torch.Tensor, layout: str, g: int) -> torch.Tensor:
    """``module`` on the G clients' activations ``h``: each client's mask drawn from its own
    key (``module.key.clients`` [G]) over its own [B, ...] activation, as it is alone."""
    if not module.training or module.p == 0:
        return h
    if module.key is None:
        raise RuntimeError("a stacked step without dropout keys (train_clients_together sets them)")
    per_client = h.shape[1:] if layout == GB else (h.shape[0], h.shape[1] // g, *h.shape[2:])
    mask = module.draw(per_client, h.dtype)  # [G, B, ...] (channelwise: [G, B, C, 1, ...])
    if layout == GRP:  # [G, B, C, ...] -> [B, G*C, ...]
        mask = mask.transpose(0, 1).reshape(mask.shape[1], g * mask.shape[2], *mask.shape[3:])
    return h * mask


@torch.no_grad()
def adam_update_(
    ps: list[torch.Tensor], ds: list[torch.Tensor], ss: list[tuple], lr: float, betas: tuple[float, float],
    weight_decay: float, eps: float = 1e-8,
) -> None:  # fmt: skip
    """torch.optim.Adam's update (amsgrad off) of stacked clients' rows, in place: each
    parameter's rows ``ps[i]`` [a, ...], gradients ``ds[i]``, state ``ss[i]`` = (m, v, t),
    t [a] each client's own step count: d = g + wd*p; m = lerp(m, d, 1 - b1);
    v = b2*v + (1 - b2)*d^2; t += 1; p -= lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)."""
    b1, b2 = betas
    if weight_decay:
        ds = torch._foreach_add(ds, ps, alpha=weight_decay)
    ms, vs, ts = [st[0] for st in ss], [st[1] for st in ss], [st[2] for st in ss]
    torch._foreach_add_(ts, 1.0)
    torch._foreach_lerp_(ms, ds, 1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, ds, ds, value=1 - b2)
    for p, mo, v, t in zip(ps, ms, vs, ts):
        # [D] as torch's non-capturable Adam: the bias corrections in float64 (there Python
        # floats), cast to the parameter's dtype where they meet it, and its addcdiv's order
        # (step * m) / denom: on a CPU the same bits as torch.optim.Adam for the same gradients
        shape = (-1, *[1] * (p.dim() - 1))
        t64 = t.double()
        step_size = ((lr / (1 - torch.pow(b1, t64))) * -1).to(p.dtype).view(shape)
        bc2_sqrt = ((1 - torch.pow(b2, t64)) ** 0.5).to(p.dtype).view(shape)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p.add_(step_size * mo / denom)


def _batch_table(
    jobs: Sequence[ClientJob], epochs: int, bs: int, epoch_rows: Callable[[int], int] | None = None
):
    """Per client, the rows of each step's minibatch in the engine's data, padded with -1:
    [M, T, bs] in host memory, T = the largest step count. ``epoch_rows(n)``: the rows of an epoch that
    train (``TrainSpec.epoch_rows``: all, or with drop_last the full minibatches), the first
    of each epoch's permutation, as ``train_client`` takes them; a job's ``epoch_steps``: its
    epochs' first minibatches only (each epoch's permutation is drawn whole all the same)."""
    tables, steps = [], []
    for job in jobs:
        n = job.n
        end = n if epoch_rows is None else epoch_rows(n)
        spe = math.ceil(end / bs)
        pad = spe * bs - end
        cut = spe if job.epoch_steps is None else min(spe, job.epoch_steps)
        rows = []
        for e in range(epochs):
            perm = (torch.randperm(n, generator=job.generator) + job.start)[:end]
            if job.draw_offsets:
                perm += job.draw_offsets[e]
            if pad:
                perm = torch.cat([perm, torch.full((pad,), -1, dtype=perm.dtype)])
            rows.append(perm.view(spe, bs)[:cut])
        tables.append(torch.cat(rows))
        steps.append(cut * epochs)
    t_max = max(steps)
    out = torch.full((len(jobs), t_max, bs), -1, dtype=torch.long)
    for j, tab in enumerate(tables):
        out[j, : len(tab)] = tab
    return out, steps


# [D] The client-by-client steps' worker threads and model replicas live across rounds:
# starting the threads and deep-copying the model every round cost about 15 ms of a 95 ms
# round on digits (benchmarks/simulation.py --preset digits, 2 threads).
_POOLS: dict[int, ThreadPoolExecutor] = {}
_REPLICAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _worker_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, started once per process (idle between rounds)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="fedforget-client")
    return _POOLS[workers]


def _replicas(model: nn.Module, n: int) -> list[nn.Module]:
    """``n`` copies of ``model`` for the client-by-client steps (``_replica``; each client's
    weights are loaded into one, so only the architecture is kept), made again whenever the
    model's parameters, buffers, modules or hooks differ from those they were copied from."""
    layout = (
        tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in itertools.chain(model.named_parameters(), model.named_buffers())),
        repr(model),
        tuple((tuple(m._forward_pre_hooks), tuple(m._forward_hooks), tuple(m._backward_hooks)) for m in model.modules()),
    )
    kept = _REPLICAS.get(model)
    if kept is None or kept[0] != layout or len(kept[1]) < n:
        kept = _REPLICAS[model] = (layout, [_replica(model) for _ in range(n)])
    return kept[1][:n]


def _replica(model: nn.Module) -> nn.Module:
    """A training-mode copy of ``model`` whose every parameter takes a gradient (the stacked
    step differentiates all of them, frozen or not, as it always has)."""
    net = copy.deepcopy(model).train()
    for q in net.parameters():
        q.requires_grad_(True)
    return net


def join_run_grads(values: list, sizes: list[int]) -> torch.Tensor | Held | None:
    """One parameter's gradients from consecutive runs of a stack's clients (each [a_i, ...];
    None where a method's gradient map holds it for the run, as SCR's for the classifier; or
    a ``Held``), joined in the stack's order: None where every run holds it, a ``Held``
    where some clients do (the optimizer skips their rows, as torch.optim skips a None grad
    of a client alone), else the gradients [G, ...]."""
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat(values)
    like = next(v.grad if isinstance(v, Held) else v for v in values if v is not None)
    grads, held = [], []
    for v, a in zip(values, sizes):
        if isinstance(v, Held):
            grads.append(v.grad)
            held.append(v.held)
        else:
            grads.append(like.new_zeros((a, *like.shape[1:])) if v is None else v)
            held.append(torch.full((a,), v is None, dtype=torch.bool, device=like.device))
    return Held(torch.cat(grads), torch.cat(held))


def lr_on_device(device: torch.device) -> bool:
    """Whether the batched engine's SGD reads its lr from a tensor on ``device``: on a GPU [D].
    A CUDA graph keeps the Python numbers its kernels were launched with, so a step that
    updates with ``alpha=-lr`` replays for that lr only, and with ``train.lr_decay`` (every
    FedSOL table) FedAvg's graphs were captured anew every round. With the lr in a tensor
    (``StepGraphs.lr``) one graph serves every round. The update is then
    ``p.addcmul_(d, lr, value=-1)``, one parameter at a time: on this project's CPU the same
    bits as ``add_(d, alpha=-lr)`` (tested), on a GPU checked by
    ``benchmarks/gpu.sh`` (``test_lr_in_a_tensor_updates_as_a_number``). torch.optim.SGD's
    compiled form, ``p + (d * -lr)`` [C], rounds twice and moves results. On a CPU, where no
    graph runs, the lr stays a number."""
    return device.type == "cuda"


def train_clients_together(
    model: nn.Module,
    global_params: dict[str, torch.Tensor],
    batch: Batcher,
    jobs: Sequence[ClientJob],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    epochs: int,
    batch_size: int,
    step_terms: Callable[[list[int]], StepTerms | None] | None = None,
    graphs: StepGraphs | None = None,
    read_ahead: bool = False,
    epoch_rows: Callable[[int], int] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    sees_step: bool = False,
    step_rows: bool = False,
    full_width: bool | None = None,
    live_terms: Callable[[list[int]], LiveTerms | None] | None = None,
    optimizer: str = "sgd",
    betas: tuple[float, float] = (0.9, 0.999),
    capturable_terms: bool = False,
) -> list[ClientResult]:
    """Local SGD of every job from ``global_params``, all clients in one batched step;
    ``batch(pos)``: the engine's training rows at positions ``pos`` (``ClientJob.start``;
    the trainer's ``masked_batch``): (x, y, logit mask or None: ``FedAvg.task_mask``), each [*pos.shape, ...].
    ``step_terms(order)``: the method's per-step loss and gradient terms
    (``FedAvg.client_step_terms``) for the jobs in that order (indices into ``jobs``), the
    order of the stack. ``graphs`` (on a GPU): the batched steps replayed as CUDA graphs
    (``fedforget.cudagraph``) on ``stacked_forward`` models: FedAvg's, and those with a
    method's terms where it declares them capturable, with Adam, per-task heads or a
    streamed pool's minibatches read ahead.
    ``read_ahead`` (a streamed pool on a GPU, ``Pool.read_ahead``): the batched steps'
    gathers run up to two steps ahead on a background thread (``fedforget.inputs.prefetched``,
    as ``train_client``'s minibatches), the same rows in the same order. ``epoch_rows``:
    the rows of an epoch that train (``TrainSpec.epoch_rows``; default all). ``autocast()``:
    the context of every forward pass (``LocalTrainer.autocast``: ``train.precision``); the
    losses are taken on fp32 logits, as autocast takes them in a client's own step.
    BatchNorm's running statistics are kept per client, stacked like the weights, and
    updated as each client's own forward passes update them alone; a step whose clients
    have batches of different sizes then runs as one batched step per run of clients with
    batches of one size (``segments``: padding rows would enter the batch statistics). ``sees_step``: the terms take the step's minibatch
    (``methods.base.StepBatch``; keyed dropout only where stacked_forward runs the model:
    ``why_not_vectorized``). ``live_terms(order)``: the method's terms of the step's own
    forward pass (``FedAvg.client_live_terms``: an extra loss of the logits, or a second
    pass at perturbed weights), for models ``stacked_forward`` runs. ``optimizer``: sgd
    (``momentum``, ``weight_decay``) or adam (``betas``, ``weight_decay`` as torch.optim.Adam's
    L2 term, eps 1e-8; its two moments and step count kept per client).
    ``step_rows``: the live terms read each client's real rows (``StepBatch.rows``), counted
    on the host as for ``sees_step``; without it the live step's rows are None (its mask only).
    ``capturable_terms``: the method's terms may run in CUDA graphs (``graphs``; see below).
    Results come back in the order of ``jobs``."""
    device = next(iter(global_params.values())).device
    order = sorted(range(len(jobs)), key=lambda j: -jobs[j].n)  # most steps first
    terms = None if step_terms is None else step_terms(order)
    live = None if live_terms is None else live_terms(order)
    if live is not None and terms is not None and sees_step:  # (methods.plugin: not composed)
        raise ValueError("step terms that see the step over live terms are not composed")
    join = live.rows if isinstance(live, JoinedLive) else None  # rows a method joins to each step's
    replaces = join is not None and live.replaces  # (or puts in place of them: CFeD's reviewers)
    jobs_sorted = [jobs[j] for j in order]
    m = len(jobs_sorted)
    # in host memory, and on the device (the same tensor on a CPU): a streamed pool's
    # read-ahead gathers from host positions (ClientData.batch)
    host_table, steps = _batch_table(jobs_sorted, epochs, batch_size, epoch_rows)
    table = host_table.to(device)

    # per-task heads (TaskHeads): the active task's head trains, the other tasks' heads are not
    # in the stack (as a client alone, whose optimizer skips them: no gradient); every client
    # of the stack is in the active task (per-task heads need synchronous boundaries)
    heads = model.head if isinstance(getattr(model, "head", None), TaskHeads) else None
    idle = {f"head.heads.{t}." for t in range(len(heads.heads)) if t != heads.active} if heads is not None else set()
    # the parameters that train: a frozen encoder's (requires_grad False) are not stacked, and
    # each client's result keeps the global ones, as a client alone leaves them
    names = [k for k, q in model.named_parameters() if q.requires_grad and not any(k.startswith(h) for h in idle)]
    # BatchNorm's running statistics (unstacked_buffers): per client, [G, ...], updated in place
    fixed = fixed_buffers(model)
    buffer_names = [k for k, _ in model.named_buffers() if k not in fixed]
    # the parameters the model holds in this task (``Classifier.held``: freeze_stages), which
    # the forward reads and no client trains: stacked beside the statistics, never updated
    held = getattr(model, "held", frozenset())
    held_names = [k for k, q in model.named_parameters() if k in held and not q.requires_grad]
    # BatchNorm, with running statistics or without (norm: batch_stateless): its batch
    # statistics would see padding rows, and it amplifies the thread count's rounding
    batch_stats = bool(buffer_names) or normalises_by_batch(model)
    # On a CPU, a grouped Conv2d over many rows is slower than the clients' convolutions one
    # after another, while over few rows batching wins (benchmarks/engine_choice.py step, 2
    # threads: McMahan CNN, 10 clients x 32 rows, 131 ms batched vs 114 ms one by one, x 4
    # rows 21 vs 32 ms; cnn2d x 4 rows 6.0 vs 14.9 ms; cnn2d x 32 varies between runs, 28.5 vs
    # 24.6 and 32.5 vs 39.9 ms). So Conv2d models on a CPU run steps of >= LOOP_MIN_ROWS rows client by client
    # and the short steps (the clients' last, partial batches) batched. The choice depends
    # only on batch widths, never on timings, so results stay deterministic; a client's
    # arithmetic is the same whichever worker thread runs it, so the split of clients over
    # the workers (each takes the next client as it finishes one) changes no result. A frozen
    # convolution (L2P's ViT patch embedding) is one map over every client's rows: not counted.
    loop_wide = loops_wide_steps(model, device)
    steps_t = torch.tensor(steps)
    # real rows per (client, step): a prefix of the batch (padding sits at the end), so a
    # step needs only as many columns as its fullest active client has rows
    width = (host_table >= 0).sum(-1)  # [M, T]
    n_steps = table.shape[1]
    active_at = [int((steps_t > k).sum()) for k in range(n_steps)]  # a prefix: sorted by step count
    wide = [loop_wide and int(width[: active_at[k], k].max()) >= LOOP_MIN_ROWS for k in range(n_steps)]
    # every step client by client (a CPU's usual case): each client trains from the global
    # weights in its own replica, and no stack is built
    alone = all(wide)
    if full_width is None:
        full_width = device.type == "cuda" and not batch_stats

    def stack(k: str) -> torch.Tensor:  # the global tensor k once per client, [m, ...]
        return global_params[k].unsqueeze(0).repeat(m, *[1] * global_params[k].dim())

    states: list[dict[str, torch.Tensor] | None] = [None] * m  # alone: each client's final state
    use_stacked = stacked_supported(model) is None
    if live is not None and not use_stacked:
        raise ValueError(f"live terms need stacked_forward (module {stacked_supported(model)}): why_not_vectorized")
    adam = optimizer == "adam"
    staged = type(getattr(model, "body", None)) is ResNetBody  # forward_levels: its stages
    # CUDA graphs (fedforget.cudagraph), for models stacked_forward runs (vmap steps stay
    # eager): FedAvg's SGD steps in graphs kept across rounds, on the persistent stack; [D]
    # steps that read this group's own tensors (a method's terms, Adam's moments; per-task
    # heads change the stack's names) in graphs that live for this call (StepGraphs.scope),
    # for a method that declares its terms capturable (FedAvg.capturable_terms), and only a
    # step shape met at least SCOPED_MIN_USES times here (a capture costs about a step)
    persistent = terms is None and live is None and not adam and heads is None
    if graphs is not None and not (use_stacked and (persistent or capturable_terms)):
        graphs = None
    if graphs is not None and no_graphs(model):
        graphs = None
    if graphs is not None and persistent:
        params, bufs, loss_sum, stats = graphs.stack(global_params, names, m, bool(momentum), buffer_names + held_names)
    else:
        params = {k: stack(k) for k in names} if not alone else {}
        bufs = {k: torch.zeros_like(v) for k, v in params.items()} if momentum and not alone else None
        loss_sum = torch.zeros(m, device=device)
        stats = {k: stack(k) for k in buffer_names + held_names} if not alone else {}
    # SGD's lr as a tensor on a GPU (lr_on_device), the persistent graphs' own across rounds
    step_lr: float | torch.Tensor = lr
    if lr_on_device(device) and not adam:
        step_lr = (graphs.lr(lr) if graphs is not None and persistent
                   else torch.full((), lr, dtype=global_params[names[0]].dtype, device=device))  # fmt: skip
    # the optimizer's state per parameter, stacked [m, ...]: SGD's momentum buffer, or Adam's
    # two moments and each client's step count [m]
    def fresh_state(v: torch.Tensor, rows: int) -> tuple:
        """One parameter's optimizer state at the round's start, ``v`` its ``rows`` clients' rows."""
        if adam:
            return torch.zeros_like(v), torch.zeros_like(v), torch.zeros(rows, device=device)
        return (torch.zeros_like(v),)

    if adam:
        ostate = {} if alone else {k: fresh_state(v, m) for k, v in params.items()}
    else:
        ostate = {k: (b,) for k, b in bufs.items()} if bufs is not None else {}

    def state_rows(lo: int, hi: int) -> list[tuple] | None:
        return [tuple(t[lo:hi] for t in ostate[n]) for n in names] if ostate else None
    # keyed dropout (fedforget.dropout): each client's masks from its key and its step, k of
    # the stack (a device tensor, so that captured steps read it)
    drop = keyed_modules(model)
    keys = key_tensor([j.dropout_key for j in jobs_sorted], device)
    step_t = torch.zeros((), dtype=torch.int64, device=device)
    if drop and graphs is not None and persistent:
        keys, step_t = graphs.dropout_inputs(keys)
    # a training encoder's masks (KeyedCalls.draw_stack): each client's from its host key and the
    # step's number, over its real rows in each pass (pass_rows); its steps run eagerly (no_graphs)
    encoder = training_encoder(model) if use_stacked else None
    hosts = tuple(j.dropout_key for j in jobs_sorted)

    def step_key(lo: int, hi: int, k: int | None, rows: list[int] | None) -> DropoutKey:
        """The dropout key of a batched step k of clients lo..hi-1 (``rows``: their real rows)."""
        if encoder is None:
            return DropoutKey(keys[lo:hi], step_t)
        return DropoutKey(keys[lo:hi], k, hosts=hosts[lo:hi], rows=rows)

    @contextlib.contextmanager
    def pass_rows(rows: list[int] | None):
        """A training encoder's real rows per client for the passes inside (a method's rows
        through the stack: ``stack_pass``), the step's own after."""
        key = encoder.draws.key if encoder is not None and encoder.draws is not None else None
        if key is None:
            yield
            return
        saved, key.rows = key.rows, rows
        try:
            yield
        finally:
            key.rows = saved

    def client_loss(p, st, xb, yb, mask, lm, key):
        if drop:  # inside vmap: the client's own key
            set_dropout_key(drop, DropoutKey(key, step_t))
        with autocast():
            out = functional_call(model, {**p, **st}, (xb,))
        logits = masked_logits(out.float(), lm)
        per = F.cross_entropy(logits, yb, reduction="none") * mask
        return per.sum() / mask.sum(), out.detach()

    one_fn = grad_and_value(client_loss, has_aux=True)  # the aux: the step's logits (StepBatch)

    def task_losses(out: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor, lm) -> torch.Tensor:
        """Each client's cross-entropy [a] on its real rows (``mask``) of the logits [a, w, C]."""
        per = F.cross_entropy(masked_logits(out.float(), lm).flatten(0, 1), yb.flatten(), reduction="none")
        return (per.view(mask.shape) * mask).sum(1) / mask.sum(1)

    def live_pass(lo: int, w: dict, step: StepBatch, second: Callable[[dict, bool], torch.Tensor], mask, lm):
        """The gradients {name: [a, ...]} and logged losses [a] of a step with the method's
        live terms: ``step`` carries the first pass (logits and task losses, live in ``w``);
        ``second(w2, head_only)``: the logits of the second pass at weights ``w2`` (the head
        alone on the first pass's body features when only head weights moved)."""
        res: LiveStep = live(lo, lo + step.x.shape[0], w, step)
        if (res.loss is not None or res.total is not None) and res.eps is not None:
            raise ValueError("live terms returned both a loss and a perturbation")
        if res.eps is None:
            total = res.total if res.total is not None else step.loss if res.loss is None else step.loss + res.loss
            gs = torch.autograd.grad(total.sum(), list(w.values()), allow_unused=True)
            adv = None
        else:
            total = step.loss  # logged: the task loss at w (FedSAM, FedSOL)
            w2 = {n: (v.detach() + res.eps[n]).requires_grad_() if n in res.eps else v for n, v in w.items()}
            head_only = all(n.startswith("head.") for n in res.eps)
            adv = task_losses(second(w2, head_only), step.y, mask, lm)
            gs = torch.autograd.grad(adv.sum(), list(w2.values()), allow_unused=True)
            adv = adv.detach()
        grads = {n: torch.zeros_like(v) if g is None else g for (n, v), g in zip(w.items(), gs)}
        if res.gmap is not None:
            with torch.no_grad():
                grads = res.gmap(grads)
        if res.done is not None:
            res.done(grads, adv)
        return grads, total.detach()

    def stacked_step(p_act, st_act, xb, yb, mask, lm, rows=None, lo=0, k=None):
        """(gradients, losses, logits) of the clients lo.. of the stack (weights ``p_act``,
        BatchNorm statistics ``st_act``, updated in place): the same values as ``step_fn``.
        A method's joined rows (``JoinedLive``) join the batch first; with BatchNorm, clients
        whose joined batches differ in size run apart, a run of one size at a time."""
        if join is not None:
            extra = join(lo, lo + xb.shape[0], k, rows) if replaces else join(lo, lo + xb.shape[0], k)
            xb, yb, mask, lm, rows = joined_batch(xb, yb, mask, lm, rows, extra)
            if batch_stats and len(set(rows)) > 1:
                return joined_runs(p_act, st_act, xb, yb, mask, lm, rows, lo, k)
        return one_pass(p_act, st_act, xb, yb, mask, lm, rows, lo, k)

    def joined_batch(xb, yb, mask, lm, rows, extra):
        """Each client's real rows (the first ``rows[j]``) followed by its joined rows
        ``extra[j]`` ((x, y) or None), zero padding after: (x, y, mask, logit mask, rows).
        ``replaces`` (JoinedLive): a client's joined rows instead of its real ones."""
        if replaces:
            rows = [0 if e is not None else r for r, e in zip(rows, extra)]
        widths = [r + (0 if e is None else len(e[1])) for r, e in zip(rows, extra)]
        a, w = len(rows), max(widths)
        x2, y2 = xb.new_zeros((a, w, *xb.shape[2:])), yb.new_zeros((a, w))
        m2 = mask.new_zeros((a, w))
        lm2 = None if lm is None else lm.new_ones((a, w, lm.shape[-1]))  # joined rows: every class
        for j, (r, e) in enumerate(zip(rows, extra)):
            x2[j, :r], y2[j, :r] = xb[j, :r], yb[j, :r]
            if lm is not None:
                lm2[j, :r] = lm[j, :r]
            if e is not None:
                x2[j, r : widths[j]], y2[j, r : widths[j]] = e[0].to(xb.dtype), e[1]
            m2[j, : widths[j]].fill_(1.0)  # (a number set by [] = would be a host tensor)
        return x2, y2, m2, lm2, widths

    def joined_runs(p_act, st_act, xb, yb, mask, lm, rows, lo, k):
        """``one_pass`` over each maximal run of clients whose joined batches have one size
        (BatchNorm: padding rows would enter the batch statistics); their gradients, losses
        and logits (padded to the widest) put back in the stack's order."""
        parts, i = [], 0
        while i < len(rows):
            j = i
            while j < len(rows) and rows[j] == rows[i]:
                j += 1
            xs = [None if t is None else t[i:j, : rows[i]] for t in (xb, yb, mask, lm)]
            parts.append(one_pass({n: v[i:j] for n, v in p_act.items()}, {n: v[i:j] for n, v in st_act.items()},
                                  *xs, rows[i:j], lo + i, k))  # fmt: skip
            i = j
        sizes = [len(loss) for _, loss, _ in parts]
        grads = {n: join_run_grads([g[n] for g, _, _ in parts], sizes) for n in parts[0][0]}
        w = xb.shape[1]
        logits = torch.cat([F.pad(z, (0, 0, 0, w - z.shape[1])) for _, _, z in parts])
        return grads, torch.cat([loss for _, loss, _ in parts]), logits

    def one_pass(p_act, st_act, xb, yb, mask, lm, rows=None, lo=0, k=None):
        """``stacked_step``'s forward and backward of one batch."""
        leaves = {n: v.detach().requires_grad_() for n, v in p_act.items()}
        if drop:
            set_dropout_key(drop, step_key(lo, lo + xb.shape[0], k, rows))
        if live is not None:  # the method's terms of this forward pass (client_live_terms)
            lv = [] if staged else None  # the ResNets' levels (StepBatch.levels)
            with autocast():
                feats = stacked_features(model, {**leaves, **st_act}, xb, lv)
                out = stacked_head(model, leaves, feats)

            def second(w2: dict, head_only: bool) -> torch.Tensor:
                """[D] BatchNorm's statistics are updated by the first pass alone (FedSAM, FedSOL:
                restored after the second): the second pass updates copies."""
                with autocast():
                    if head_only:
                        return stacked_head(model, w2, feats)
                    return stacked_forward(model, {**w2, **{n: v.clone() for n, v in st_act.items()}}, xb)

            step = StepBatch(xb, yb, rows, out.float(), functools.partial(stack_forward, lo=lo), stack_grad,
                             task_losses(out, yb, mask, lm), feats.float(), stack_features, mask, stack_logits,
                             None if lv is None else [v.float() for v in lv], k,
                             lambda w, x, rows=None: stack_forward(w, x, None, rows, lo, features=True))  # fmt: skip
            grads, losses = live_pass(lo, leaves, step, second, mask, lm)
            return grads, losses, out.detach()
        with autocast():
            out = stacked_forward(model, {**leaves, **st_act}, xb)
        logits = masked_logits(out.float(), lm)  # [a, w, C]
        per = F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none").view(mask.shape)
        losses = (per * mask).sum(1) / mask.sum(1)  # each client's mean over its real rows
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, grads)), losses.detach(), out.detach()

    def update_(ps: list, ds: list, ss: list[tuple] | None) -> None:
        """The optimizer's update in place (``_sgd_update``, ``adam_update_``), ``ss`` each
        parameter's state rows (``state_rows``; None: SGD without momentum); a parameter
        whose gradient is None (a method's gradient map holds it this step) is skipped, as
        torch.optim skips it: no decay, no momentum, no step counted."""
        if any(d is None for d in ds):
            keep = [i for i, d in enumerate(ds) if d is not None]
            ps, ds = [ps[i] for i in keep], [ds[i] for i in keep]
            ss = None if ss is None else [ss[i] for i in keep]
            if not ps:
                return
        # held by some clients (methods.base.Held): those clients' rows are put back after
        # the update, the parameter and its optimizer state, as if skipped
        held = [(ps[i], ss[i] if ss else (), d.held, ps[i].clone(), tuple(t.clone() for t in ss[i]) if ss else ())
                for i, d in enumerate(ds) if isinstance(d, Held)]  # fmt: skip
        ds = [d.grad if isinstance(d, Held) else d for d in ds]
        if adam:
            adam_update_(ps, ds, ss, lr, betas, weight_decay)
        else:
            _sgd_update(ps, ds, None if ss is None else [st[0] for st in ss])
        for p, st, h, p0, st0 in held:
            p.copy_(torch.where(h.view(-1, *[1] * (p.dim() - 1)), p0, p))
            for t, t0 in zip(st, st0):
                t.copy_(torch.where(h.view(-1, *[1] * (t.dim() - 1)), t0, t))

    def _sgd_update(ps: list, ds: list, bs: list | None) -> None:
        if weight_decay:
            ds = torch._foreach_add(ds, ps, alpha=weight_decay)
        if bs is not None:
            torch._foreach_mul_(bs, momentum)
            torch._foreach_add_(bs, ds)
            ds = bs
        if isinstance(step_lr, torch.Tensor):  # lr_on_device: the bits of alpha=-lr (tested)
            for p, d in zip(ps, ds):
                p.addcmul_(d, step_lr, value=-1)
        else:
            torch._foreach_add_(ps, ds, alpha=-lr)

    def stack_forward(
        w: dict, x: torch.Tensor, task: torch.Tensor | None, rows: list[int] | None = None, lo: int = 0,
        features: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [a, m, C] of the stack's weights ``w`` [a, ...] (its clients lo..lo+a-1) on
        its inputs [a, m, ...] (StepBatch.forward): with per-task heads each row through its
        own task's head (``task`` [a, m], as ``Classifier.row_logits``; ``head_scores``),
        else the model's. With BatchNorm, each client's running statistics are updated by its
        own real rows (the first ``rows[j]``; padding never enters the batch statistics): one
        stacked pass where every client has as many, else client by client; a client without
        rows is not run. ``features``: (body features [a, m, F], logits of every class by its
        newest head, ``TaskHeads.combined``) instead (StepBatch.features_logits)."""
        if heads is None and not features:
            return stack_pass(w, x, rows, lo).float()
        feats = stack_pass(w, x, rows, lo, body=True)
        with autocast():
            out = head_scores(w, feats, task, combined=features)
        return (feats.float(), out.float()) if features else out.float()

    def stack_pass(w: dict, x: torch.Tensor, rows: list[int] | None, lo: int, body: bool = False) -> torch.Tensor:
        """The model's logits (``body``: its body's features) [a, m, ...] for the stack's
        weights ``w`` on its inputs [a, m, ...], in the step's precision, BatchNorm's
        statistics updated as ``stack_forward`` says."""
        mod, cut = (model.body, "body.") if body else (model, "")
        stacked = stacked_features if body else stacked_forward
        own = {n[len(cut):]: v for n, v in w.items() if n.startswith(cut)}  # ``mod``'s own names
        with autocast(), pass_rows(rows):
            if batch_stats:
                a, width = x.shape[0], x.shape[1]
                full = {n: v[lo : lo + a] for n, v in stats.items()}
                st = {n[len(cut):]: v for n, v in full.items() if n.startswith(cut)}
                if rows is None or len(set(rows)) == 1:
                    n_rows = width if rows is None else rows[0]
                    if use_stacked:
                        out = stacked(model, {**w, **full}, x[:, :n_rows])
                    else:
                        out = vmap(lambda p, b, xb: functional_call(mod, {**p, **b}, (xb,)))(own, st, x[:, :n_rows])
                else:
                    outs = [
                        functional_call(mod, {**{n: v[j] for n, v in own.items()}, **{n: v[j] for n, v in st.items()}},
                                        (x[j, : rows[j]],)) if rows[j] else None
                        for j in range(a)
                    ]  # fmt: skip
                    first = next(o for o in outs if o is not None)
                    out = x.new_zeros((a, width, *first.shape[1:]), dtype=first.dtype)
                    for j, o in enumerate(outs):
                        if o is not None:
                            out[j, : rows[j]] = o
                if out.shape[1] < width:
                    out = torch.cat([out, out.new_zeros((a, width - out.shape[1], *out.shape[2:]))], 1)
                return out
            if use_stacked:
                return stacked(model, w, x)
            if x.shape[0] == 1:
                return functional_call(mod, {n: v[0] for n, v in own.items()}, (x[0],)).unsqueeze(0)
            return vmap(lambda p, xb: functional_call(mod, p, (xb,)))(own, x)

    # per-task heads: the classes whose newest head up to the active task is head t < active
    # (TaskHeads.combined), bool [C] on the device, made once (a captured step copies nothing in)
    owned: dict[int, torch.Tensor] = {}
    if heads is not None:
        owner = heads.owners()
        for t in sorted(set(owner) - {heads.active}):
            owned[t] = torch.tensor([o == t for o in owner], device=device)

    def head_scores(w: dict, feats: torch.Tensor, task: torch.Tensor | None, combined: bool = False) -> torch.Tensor:
        """Logits [a, m, C] of body features [a, m, F]: the head's, stacked weights ``w``. With
        per-task heads, the active head's for the rows (``task`` [a, m]: each row's task; a
        later task's too) or classes (``combined``: each class's newest head) it scores, an
        earlier task's head, frozen at its global weights (shared by the stack), for the
        others, as ``Classifier.row_logits`` and ``TaskHeads.combined`` route them."""
        out = stacked_head(model, w, feats)
        if heads is None or (task is None and not combined):
            return out
        for t in owned if combined else range(heads.active):
            sel = owned[t] if combined else (task == t).unsqueeze(-1)
            wt, bt = global_params[f"head.heads.{t}.weight"], global_params.get(f"head.heads.{t}.bias")
            out = torch.where(sel, F.linear(feats, wt, bt).to(out.dtype), out)
        return out

    @torch.no_grad()
    def frozen_pass(net: nn.Module, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()``'s output in float32, ``net`` in eval mode (keyed dropout off, as a frozen
        copy computes it) under the step's precision, no graph; training mode restored."""
        net.eval()
        try:
            with autocast():
                return fn().float()
        finally:
            net.train()

    def stack_features(w: dict, x: torch.Tensor) -> torch.Tensor:
        """Body features [a, m, F] of stacked weights ``w`` on inputs [a, m, ...], keyed
        dropout off (StepBatch.features_of: as a frozen copy in eval mode computes them; with
        BatchNorm ``w`` holds the running statistics it normalises by, as that copy's)."""
        return frozen_pass(model, lambda: stacked_features(model, w, x))

    def stack_logits(w: dict, x: torch.Tensor) -> torch.Tensor:
        """Logits [a, m, C] of stacked weights ``w`` on inputs [a, m, ...], keyed dropout off
        (StepBatch.logits_of): the live step's own kernels (``stacked_features``, then
        ``stacked_head``), so at the step's weights they are its logits bit for bit. [D] A
        frozen module over the flattened rows would differ from the stack's batched matmuls
        in the last bits on a GPU (H200, 2026-11-27): FedSOL's KL gradient at w = w_g was
        then a rounding vector instead of 0, logged and projected on. With BatchNorm ``w``
        holds the running statistics (eval mode), so the logits are not the training pass's
        (batch statistics), on a client alone neither."""
        return frozen_pass(model, lambda: stacked_head(model, w, stacked_features(model, w, x)))

    def stack_grad(loss: torch.Tensor, w: dict) -> dict:
        # the graph is kept: a method's live terms differentiate the step's own forward pass,
        # which the trainer's backward then follows
        gs = torch.autograd.grad(loss, list(w.values()), allow_unused=True, retain_graph=live is not None)
        return {n: torch.zeros_like(v) if g is None else g for (n, v), g in zip(w.items(), gs)}

    def step_batch(xb: torch.Tensor, yb: torch.Tensor, rows: list[int], logits: torch.Tensor, k: int,
                   net: nn.Module | None = None, lo: int = 0) -> StepBatch:  # fmt: skip
        """Step k's StepBatch (xb, yb [a, w, ...], the step's logits [a, w, C]) of the
        stack's clients lo..; ``net``: a client's own replica (``loop_client_``), whose
        forward the memory rows then take."""
        if net is None:
            return StepBatch(xb, yb, rows, logits, functools.partial(stack_forward, lo=lo), stack_grad, k=k,
                             features_logits=lambda w, x, rows=None: stack_forward(w, x, None, rows, lo, features=True))  # fmt: skip

        def own_body(w: dict, x: torch.Tensor) -> torch.Tensor:  # [1, m, F]; the replica's statistics
            return functional_call(net.body, {n[5:]: v[0] for n, v in w.items() if n.startswith("body.")}, (x[0],)).unsqueeze(0)

        def own_forward(w: dict, x: torch.Tensor, task: torch.Tensor | None, rows: list[int] | None = None) -> torch.Tensor:
            with autocast():
                if heads is None:
                    return functional_call(net, {n: v[0] for n, v in w.items()}, (x[0],)).unsqueeze(0).float()
                return head_scores(w, own_body(w, x), task).float()

        def own_features_logits(w: dict, x: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            with autocast():
                feats = own_body(w, x)
                out = head_scores(w, feats, None, combined=True)
            return feats.float(), out.float()

        return StepBatch(xb, yb, rows, logits, own_forward, stack_grad, k=k, features_logits=own_features_logits)

    def add_terms(lo: int, hi: int, w: dict, grads: dict, losses: torch.Tensor, step: StepBatch | None = None):
        """The method's per-step terms (``client_step_terms``) of clients lo..hi-1 added to
        their gradients and losses ([hi - lo, ...] each), then its gradient map, if any;
        ``step``: the step's minibatch, for terms that see it (``sees_step``)."""
        if terms is None:
            return grads, losses
        leaves = {n: v.detach().requires_grad_() for n, v in w.items()}
        with torch.enable_grad():
            ext_loss, ext, gmap = terms(lo, hi, leaves, step) if sees_step else terms(lo, hi, leaves)
        if ext_loss is not None:  # the loss term's gradient, by autograd as on a client alone
            d = dict(zip(leaves, torch.autograd.grad(ext_loss.sum(), list(leaves.values()), allow_unused=True)))
            grads = {n: g + d[n] if d.get(n) is not None else g for n, g in grads.items()}
            losses = losses + ext_loss.detach()
        if ext:
            grads = {n: g + ext[n] if n in ext else g for n, g in grads.items()}
        if gmap is not None:  # e.g. FedGP's projection of the whole gradient
            with torch.no_grad():
                grads = gmap(grads)
        return grads, losses

    def loop_client_(net: nn.Module, i: int, ks: range) -> torch.Tensor:
        """Client i's steps ``ks`` on its own; returns the sum of its losses ([1]). ``net``:
        a replica of the model owned by the calling thread (``_replicas``): the client's
        weights and statistics are loaded into it, trained there by the module's own
        forward, as a client alone trains, and written back to the client's slice of the
        stack at the end (views of one stack share a version counter, so another thread's
        in-place update would invalidate this client's autograd graph)."""
        total = torch.zeros(1, device=device)
        own, own_stats = dict(net.named_parameters()), dict(net.named_buffers())
        w = [own[n] for n in names]
        with torch.no_grad():
            for n in names:
                own[n].copy_(global_params[n] if alone else params[n][i])
            for n in buffer_names:  # updated in place by the forward
                own_stats[n].copy_(global_params[n] if alone else stats[n][i])
            for n in held_names:  # read by the forward, held
                own[n].copy_(global_params[n])
        p_i = {n: own[n].detach().unsqueeze(0) for n in names}  # [1, ...] views: a stack of one
        if alone:
            s_i = [fresh_state(v, 1) for v in p_i.values()] if adam or momentum else None
        else:
            s_i = None if not ostate else [tuple(t[i : i + 1].clone() for t in ostate[n]) for n in names]
        drop_i = keyed_modules(net)
        for k in ks:
            if k >= steps[i]:
                break
            xb, yb, lm = batch(table[i, k, : int(width[i, k])])
            if drop_i:
                set_dropout_key(drop_i, DropoutKey(keys[i], k, hosts[i]))
            if live is not None:
                grads, loss = live_alone(net, i, xb, yb, lm, k)
                grads, loss = add_terms(i, i + 1, p_i, grads, loss)  # a plug-in's over them (FedGP's map)
                with torch.no_grad():
                    update_(list(p_i.values()), [grads[n] for n in names], s_i)
                total += loss
                continue
            with autocast():
                logits = net(xb)
            loss = F.cross_entropy(masked_logits(logits.float(), lm), yb).unsqueeze(0)
            grads = {n: g.unsqueeze(0) for n, g in zip(names, torch.autograd.grad(loss, w))}
            step = step_batch(xb.unsqueeze(0), yb.unsqueeze(0), [len(yb)], logits.detach().unsqueeze(0), k, net) if sees_step else None
            grads, loss = add_terms(i, i + 1, p_i, grads, loss.detach(), step)
            with torch.no_grad():
                update_(list(p_i.values()), [grads[n] for n in names], s_i)
            total += loss
        if alone:
            states[i] = {n: v[0].clone() for n, v in p_i.items()} | {n: own_stats[n].clone() for n in buffer_names}
            return total
        with torch.no_grad():
            for n, v in p_i.items():
                params[n][i : i + 1].copy_(v)
            for n, st in zip(names, s_i or []):
                for t, v in zip(ostate[n], st):
                    t[i : i + 1].copy_(v)
            for n in buffer_names:
                stats[n][i].copy_(own_stats[n])
        return total

    def live_alone(net: nn.Module, i: int, xb: torch.Tensor, yb: torch.Tensor, lm, k: int) -> tuple[dict, torch.Tensor]:
        """One step of client i with the method's live terms in its own replica ``net``
        (``loop_client_``), as a stack of one: its weights are [1, ...] views of the
        replica's parameters, which the forward passes read (``functional_call``); a second
        pass runs at new leaves w + eps, so the parameters are never written."""
        if join is not None:  # the method's rows joined to the minibatch (JoinedLive)
            extra = join(i, i + 1, k, [len(yb)])[0] if replaces else join(i, i + 1, k)[0]
            if extra is not None and replaces:  # instead of the minibatch's
                xb, yb = extra[0].to(xb.dtype), extra[1]
                lm = None if lm is None else lm.new_ones((len(yb), lm.shape[-1]))
            elif extra is not None:
                n_real = len(yb)
                xb, yb = torch.cat([xb, extra[0].to(xb.dtype)]), torch.cat([yb, extra[1]])
                if lm is not None:
                    lm = torch.cat([lm, lm.new_ones((len(yb) - n_real, lm.shape[-1]))])
        own = dict(net.named_parameters())
        w = {n: own[n].unsqueeze(0) for n in names}  # in the step's graph

        def part(mod: nn.Module, prefix: str, ws: dict, h: torch.Tensor) -> torch.Tensor:
            return functional_call(mod, {n[len(prefix) :]: v[0] for n, v in ws.items() if n.startswith(prefix)}, (h,))

        lv = None
        with autocast():
            if staged:  # the body as a stack of one, for its levels (the module's arithmetic)
                lv = []
                own_bufs = {n: b.unsqueeze(0) for n, b in net.named_buffers()}  # updated in place
                feats = stacked_features(net, {**w, **own_bufs}, xb.unsqueeze(0), lv)[0]
            else:
                feats = part(net.body, "body.", w, xb)
            out = part(net.head, "head.", w, feats)

        def second(w2: dict, head_only: bool) -> torch.Tensor:
            """The second pass at ``w2``: BatchNorm's statistics updated on copies (as the
            stacked step's ``second``: the first pass alone updates them)."""
            if not head_only:
                w2 = {**w2, **{n: b.detach().clone().unsqueeze(0) for n, b in net.named_buffers()}}
            with autocast():
                return part(net.head, "head.", w2, feats if head_only else part(net.body, "body.", w2, xb)).unsqueeze(0)

        loss = F.cross_entropy(masked_logits(out.float(), lm), yb).unsqueeze(0)

        def own_features(ws: dict, x: torch.Tensor) -> torch.Tensor:
            return frozen_pass(net, lambda: part(net.body, "body.", with_stats(ws), x[0])).unsqueeze(0)

        def own_logits(ws: dict, x: torch.Tensor) -> torch.Tensor:
            ws = with_stats(ws)
            return frozen_pass(net, lambda: part(net.head, "head.", ws, part(net.body, "body.", ws, x[0]))).unsqueeze(0)

        def with_stats(ws: dict) -> dict:
            """``ws``, which must hold the running statistics of the model it stands for (a
            frozen pass in eval mode reads them; the replica's own are this client's)."""
            missing = [n for n in buffer_names if n not in ws and torch.is_floating_point(global_params[n])]
            if missing:
                raise ValueError(f"a frozen pass without the running statistics of its weights ({missing[0]})")
            return ws

        step = step_batch(xb.unsqueeze(0), yb.unsqueeze(0), [len(yb)], out.float().unsqueeze(0), k, net)._replace(
            loss=loss, features=feats.float().unsqueeze(0), features_of=own_features, logits_of=own_logits,
            levels=None if lv is None else [v.float() for v in lv],
        )
        lm1 = None if lm is None else lm.unsqueeze(0)
        return live_pass(i, w, step, second, torch.ones(1, len(yb), device=yb.device), lm1)

    def loop_steps_(ks: range, active: int) -> None:
        """Steps ``ks`` (a run of wide steps) of the ``active`` clients, each client on its
        own: spread over ``workers`` threads of one intra-op thread each, client by client
        (a client's steps stay in order; clients share nothing but read-only data)."""
        if pool is None:
            for i in range(active):
                loss_sum[i : i + 1] += loop_client_(replicas[0], i, ks)
            return

        # clients longest first (rows over these steps), each worker taking the next client
        # when it finishes one: a client's arithmetic is the same on any thread, so the split
        # changes no result, and a worker slowed by the machine takes fewer clients
        cost = width[:active, ks.start : ks.stop].sum(1).tolist()
        todo = iter(sorted(range(active), key=lambda i: -cost[i]))
        lock = threading.Lock()

        def work(j: int) -> list[tuple[int, torch.Tensor]]:
            torch.set_num_threads(1)  # this thread's ops on one core (OpenMP and MKL)
            done = []
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return done
                done.append((i, loop_client_(replicas[j], i, ks)))

        try:
            parts = list(pool.map(work, range(min(workers, active))))
        finally:
            torch.set_num_threads(workers)  # MKL's count is process-wide: back for the batched steps
        for part in parts:
            for i, total in part:
                loss_sum[i : i + 1] += total

    def batched_step_(idx: torch.Tensor, gathered: tuple | None = None, lo: int = 0, rows: list[int] | None = None,
                      k: int | None = None) -> None:  # fmt: skip
        """Step k of the clients in ``idx`` ([a, w] rows, -1 = padding; clients lo..lo+a-1
        of the stack) together: one gather (or its result ``gathered``, read ahead), forward
        and backward, and their SGD updates. ``rows``: each client's rows in ``idx``, for
        the terms that see the step (``sees_step``), counted on the host (``step_counts``)."""
        hi = lo + idx.shape[0]
        assert rows is not None or not sees_step  # (every call passes them, captured steps too)
        xb, yb, lm = gathered or batch(idx.clamp(min=0))  # [a, w, ...]: one gather for all clients
        mask = (idx >= 0).to(xb.dtype)
        p_act = {n: v[lo:hi] for n, v in params.items()}
        st_act = {n: v[lo:hi] for n, v in stats.items()}
        if use_stacked:
            grads, losses, logits = stacked_step(p_act, st_act, xb, yb, mask, lm, rows, lo, k)
        elif hi - lo == 1:  # one client left (a large client's tail): no vmap overhead
            g1, (l1, z1) = one_fn(
                {n: v[0] for n, v in p_act.items()}, {n: v[0] for n, v in st_act.items()},
                xb[0], yb[0], mask[0], None if lm is None else lm[0], keys[lo],
            )  # fmt: skip
            grads = {n: g.unsqueeze(0) for n, g in g1.items()}
            losses, logits = l1.unsqueeze(0), z1.unsqueeze(0)
        else:
            step_fn = vmap(one_fn, in_dims=(0, 0, 0, 0, 0, None if lm is None else 0, 0))
            grads, (losses, logits) = step_fn(p_act, st_act, xb, yb, mask, lm, keys[lo:hi])
        step = step_batch(xb, yb, rows, logits, k, lo=lo) if sees_step else None
        grads, losses = add_terms(lo, hi, p_act, grads, losses.detach(), step)
        loss_sum[lo:hi] += losses
        with torch.no_grad():
            update_([p_act[n] for n in names], [grads[n] for n in names], state_rows(lo, hi))

    # the client-by-client steps use the intra-op threads as workers, one client each: small
    # convolutions gain little from a second intra-op thread (benchmarks/engine_choice.py
    # step, 10 clients x 32 rows one after another: McMahan CNN 93.5 ms on 2 intra-op threads,
    # 83.8 ms on 2 workers x 1 thread; cnn2d 28.1 vs 27.1 ms)
    # [D] BatchNorm models run them on one worker (all the intra-op threads, as the sequential
    # trainer): on a worker a client's step runs on one intra-op thread, and CPU kernels sum
    # in an order that depends on the thread count (benchmarks/thread_ops.py), a difference
    # BatchNorm's normalisation amplifies step by step (tests/test_vectorized.py's BatchNorm
    # test says how far). Re-checked on 2026-12-04 (ad hoc, ResNet-8 width 8 on digits, 2
    # threads, 2 rounds of 5 epochs of 20-row steps): batched on 2 workers it ended beyond 1e-5
    # of the sequential trainer, on one worker within it. Not a race: two single-thread
    # replicas trained at once gave the bits of the same two trained one after another.
    workers = torch.get_num_threads() if loop_wide and any(wide) and not batch_stats else 1
    pool = _worker_pool(workers) if workers > 1 else None
    replicas = _replicas(model, workers) if any(wide) else []
    if heads is not None:  # a replica keeps the architecture only: its active head is the model's
        for net in replicas:
            net.head.active = heads.active
    was_training = model.training
    model.train()

    def step_rows(k: int, rows: torch.Tensor = table) -> torch.Tensor:
        """Step k's [a, w] rows of ``rows`` (the table, or its host copy): its active clients'
        widest (full_width: all)."""
        active = active_at[k]
        return rows[:active, k] if full_width else rows[:active, k, : int(width[:active, k].max())]

    def segments(k: int) -> list[tuple[int, int, int]]:
        """Step k's parts trained as one batched step each: (lo, hi, w), clients lo..hi-1 of
        the stack on their first w rows of ``step_rows(k)``. All active clients in one,
        padded, except with BatchNorm, whose batch statistics padding rows would enter:
        [D] there the maximal runs of clients (in the stack's order) with batches of one
        size, e.g. the full-size clients, then a client's short last batch."""
        active = active_at[k]
        if not batch_stats:
            return [(0, active, table.shape[2] if full_width else int(width[:active, k].max()))]
        ws = width[:active, k].tolist()
        runs, lo = [], 0
        for i in range(1, active + 1):
            if i == active or ws[i] != ws[lo]:
                runs.append((lo, i, ws[lo]))
                lo = i
        return runs

    def step_counts(k: int, lo: int, hi: int, w: int) -> list[int] | None:
        """Clients lo..hi-1's rows among the first ``w`` of step k, for the terms that see the
        step, from the host's widths [D]: counting them in the device's table would be a
        device-to-host read at every step, which waits for the queued steps. A client's rows
        of a step are a prefix of its table row (padding only at the end)."""
        return [min(int(width[i, k]), w) for i in range(lo, hi)] if sees_step or step_rows or join or encoder is not None else None

    ahead = None
    if read_ahead:  # a streamed pool's host reads overlap the steps
        ahead = prefetched(lambda k: batch(step_rows(k, host_table).clamp(min=0)), [k for k in range(n_steps) if not wide[k]])

    def streamed_step_(idx, xb, yb, lm, lo: int = 0, rows: list[int] | None = None, k: int | None = None) -> None:
        batched_step_(idx, (xb, yb, lm), lo, rows, k)

    planned = terms.key if isinstance(terms, PlannedTerms) else None

    def step_shape(k: int, lo: int, hi: int, w: int, rows: list[int] | None) -> tuple:
        """What step k's captured kernels depend on besides the optimizer's constants: its
        clients and shape, (the terms that see the step) each client's rows, and (terms that
        follow a plan) the plan's step (``PlannedTerms.key``)."""
        return (lo, hi - lo, w, batch, persistent, tuple(rows or ()), planned and planned(k, lo, hi))

    # graphs of this call only (a method's terms; new optimizer constants, as a decaying lr
    # gives every round where it is a number): a step shape is captured if met at least
    # SCOPED_MIN_USES times here
    constants = (None if isinstance(step_lr, torch.Tensor) else lr, momentum, weight_decay, optimizer, betas)
    one_call = graphs is not None and (not persistent or graphs.constants(constants))
    uses: dict[tuple, int] = {}
    counted: dict[tuple, tuple] = {}  # (k, lo, hi, w) -> (rows, shape): each computed once a step
    if one_call:  # how often each step shape comes in this call
        for k in range(n_steps):
            if not wide[k]:
                for lo, hi, w in segments(k):
                    rows = step_counts(k, lo, hi, w)
                    counted[k, lo, hi, w] = rows, (shape := step_shape(k, lo, hi, w, rows))
                    uses[shape] = uses.get(shape, 0) + 1
    scope = graphs.scope() if graphs is not None and not persistent else contextlib.nullcontext()
    with scope:
        k = 0
        while k < n_steps:
            if wide[k]:  # a run of wide steps, client by client
                end = k
                while end < n_steps and wide[end]:
                    end += 1
                loop_steps_(range(k, end), active_at[k])
                k = end
                continue
            idx = step_rows(k)
            if drop:
                step_t.fill_(k)
            gathered = None if ahead is None else next(ahead)
            for lo, hi, w in segments(k):
                part = idx if (hi - lo, w) == tuple(idx.shape) else idx[lo:hi, :w]
                sub = None  # a streamed pool's minibatch, read ahead (x, y, logit mask or None)
                if gathered is not None:
                    sub = gathered if part is idx else tuple(None if t is None else t[lo:hi, :w] for t in gathered)
                if (k, lo, hi, w) in counted:
                    rows, shape = counted[k, lo, hi, w]
                else:
                    rows = step_counts(k, lo, hi, w)
                    shape = None if graphs is None else step_shape(k, lo, hi, w, rows)
                if graphs is None or (one_call and uses[shape] < SCOPED_MIN_USES):
                    batched_step_(part, sub, lo, rows, k)
                else:  # the step's kernels depend on its shape and constants only; a minibatch
                    # read ahead is copied into the captured step's inputs at each replay
                    step = functools.partial(batched_step_, gathered=None, lo=lo, rows=rows, k=k) if sub is None \
                        else functools.partial(streamed_step_, lo=lo, rows=rows, k=k)
                    graphs.run((*shape, *constants), part, step, *(sub or ()), shape=shape)
            k += 1
    model.train(was_training)
    set_dropout_key(drop, None)

    if graphs is not None and persistent:  # the stack is the graphs' and is overwritten next round
        params = {n: v.clone() for n, v in params.items()}
        stats = {n: v.clone() for n, v in stats.items()}
    state_keys = list(global_params)
    results: list[ClientResult | None] = [None] * m
    for j, job in enumerate(jobs_sorted):
        own = states[j] or {**{k: v[j] for k, v in params.items()}, **{k: stats[k][j] for k in buffer_names}}
        # what the client did not train is the global tensor itself (an upload is never written into)
        state = {k: own[k] if k in own else global_params[k] for k in state_keys}
        results[order[j]] = ClientResult(job.cid, state, loss_sum[j].item() / steps[j], steps[j])
    return results  # type: ignore[return-value]


def auto_prefers_sequential(model: nn.Module, device: torch.device) -> str | None:
    """Why ``client_engine: auto`` trains one client after another on ``device`` although
    the batched path is possible (None: it trains clients together): where only the ``vmap``
    fallback could batch the model (``stacked_forward`` cannot run it), on a CPU and on a GPU
    alike, and the ResNets (BatchNorm, GroupNorm, ResNet blocks) on a CPU. Measured: on 2 CPU
    cores (``benchmarks/engine_choice.py``, ``benchmarks/simulation.py``) MLP and 1-D CNN
    steps run several times faster batched, Conv2d models tie or gain through their batched
    short steps, and vmap steps are slower than a loop; on an H200 (issue 32's setting) the
    McMahan CNN batched ran 9.45x the sequential trainer (``results/h200-2026-11-27``),
    ResNet-18 with BatchNorm through vmap 0.61x the plain loop (``h200-2026-11-27-b``), and
    layer by layer in channels_last 1.72x the plain loop, against 0.79-0.96x for the
    sequential trainer (``h200-2026-11-27-c``); a frozen Hugging Face encoder's clients (its
    features kept, the heads stacked) took 1.52 s a round batched against 2.05 s on 2 CPU
    cores (``cpu-2026-12-02/feature_cache_engines.json``), a training one's (a BERT)
    stacked 0.75x one after another there as ``fedforget train`` runs it, its freed memory
    kept (``cpu-2026-12-03-d``; 0.51x under glibc's defaults, ``cpu-2026-12-03-c``; on a GPU
    not yet measured).
    [D] On a CPU the ResNets' wide steps would run client by client anyway and their batched
    short steps are not measured: sequential."""
    bad = stacked_supported(model)
    where = "a CPU" if device.type != "cuda" else "a GPU"
    if bad is not None:
        return f"auto on {where}: sequential (module {bad} would need the vmap path, slower than a loop on {where})"
    normed = next((type(m).__name__ for m in model.modules() if isinstance(m, NORMED)), None)
    if normed is not None and device.type != "cuda":
        return f"auto on a CPU: sequential (module {normed}: the stacked ResNet step is measured on a GPU only)"
    if device.type != "cuda" and training_encoder(model) is not None:
        # [D] FedProj Table 2's TinyBERT (published shapes, 4 clients x 128 rows of 128 tokens,
        # 2 threads, freed memory kept as fedforget train keeps it; cpu-2026-12-03-d/
        # hf-rates-malloc-keep-*.json): batched 19.9 samples/s and 15.1 GB peak RSS against
        # 26.4 samples/s and 4.9 GB one client after another
        return "auto on a CPU: sequential (a training Hugging Face encoder: its stacked step measured slower on a CPU)"
    vit = next((type(m).__name__ for m in model.modules() if isinstance(m, (SLViTBody, ViTBody))), None)
    if device.type != "cuda" and vit is not None:
        # [D] stacked since 2026-12-02 (SL-ViT, third session) and 2026-12-03 (torchvision's
        # ViT): their batched matmuls are unmeasured on a CPU
        return f"auto on a CPU: sequential (module {vit}: its stacked step is not measured on a CPU)"
    return None


@torch.no_grad()
def evaluate_stacked(
    model: nn.Module,
    stacked: Sequence[dict[str, torch.Tensor]],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1024,
    batched: bool | None = None,
) -> list[float]:
    """Test accuracy of several weight sets of one architecture (the local models after
    local training). ``batched`` (default: on a GPU) evaluates them all in one pass per
    test batch; otherwise one after another, which is faster on a CPU (measured: 10 cnn1d
    models on 1000 samples, 1 thread: 397 ms batched vs 113 ms one by one, benchmarks/engine_choice.py eval)."""
    was_training = model.training
    model.eval()
    if not (x.device.type == "cuda" if batched is None else batched):
        accs = []
        for params in stacked:
            correct = 0
            for s in range(0, len(y), batch_size):
                logits = functional_call(model, params, (x[s : s + batch_size],))
                correct += int((logits.argmax(-1) == y[s : s + batch_size]).sum())
            accs.append(correct / max(len(y), 1))
        model.train(was_training)
        return accs
    names = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]  # BatchNorm's statistics
    use_stacked = stacked_supported(model) is None
    if use_stacked:  # a frozen encoder's weights are its module's own there
        fixed = fixed_buffers(model) | {k for k, q in model.named_parameters() if not q.requires_grad}
        names = [k for k in names if k not in fixed]
    p = {k: torch.stack([s[k] for s in stacked]) for k in names}
    if use_stacked:
        g = len(stacked)
        fwd = lambda pp, xb: stacked_forward(model, pp, xb.expand(g, *xb.shape))  # noqa: E731
    else:
        fwd = vmap(lambda pp, xb: functional_call(model, pp, (xb,)), in_dims=(0, None))
    correct = torch.zeros(len(stacked), device=x.device, dtype=torch.float64)  # exact counts
    for s in range(0, len(y), batch_size):
        logits = fwd(p, x[s : s + batch_size])  # [M, b, C]
        correct += (logits.argmax(-1) == y[s : s + batch_size]).sum(1)
    model.train(was_training)
    return (correct / max(len(y), 1)).tolist()
