"""A method that runs over another method: the plug-in base.

Some methods change one part of training and leave the rest to any other method: FedSOL's
combined mode replaces the local step of FedProx, FedDyn, SCAFFOLD, FedNova or MOON and
keeps their server, state and aggregation [FedSOL Table 4]; FedGP projects the local
gradients of any continual base. Such a method subclasses ``OverBase``: every hook of the
API (``fedforget.methods.base``) goes to an instance of the base method named by its
hyperparameters ``base`` and ``base_params``, and the plug-in overrides only the hooks it
changes, calling ``self.base`` (or ``super()``, which is the base) where it keeps them.
The forwarding is generated once here from the hook list, not written per method; the
diagnostics a base reports (``client_end``'s stats, ``server_metrics``) come out renamed
``<base>_<key>``, beside the plug-in's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import ClientContext, ClientShape, FedAvg, RunInfo, ServerContext, Upload
from .params import make_params
from .registry import METHODS

# every hook of the method API (fedforget.methods.base); a plug-in forwards each to its base
HOOKS = (
    "model_init",
    "server_init", "server_task_begin", "server_broadcast", "server_aggregate", "server_metrics",
    "server_collect",
    "client_begin", "client_loss", "client_step", "client_grad", "client_step_terms", "client_live_terms",
    "client_end",
    "client_reply", "client_replies",
    "eval_predict", "eval_counts",
)  # fmt: skip


def base_method(params: Any, info: RunInfo) -> FedAvg:
    """The base method of a plug-in's ``params`` (``base``, ``base_params``)."""
    return METHODS.get(params.base)(make_params(params.base, dict(params.base_params), "base_params"), info)


class OverBase(FedAvg):
    """Every hook goes to ``self.base`` unless the subclass overrides it. ``Params`` must
    have ``base`` (a registered method name) and ``base_params`` (its hyperparameters)."""

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        self.base = base_method(params, info)
        self.label_classes = self.base.label_classes  # its task loss is the base's (FedAvg.task_mask)

    own_exchanges: tuple[str, ...] = ()  # the plug-in's own extra exchanges (FedGP: ROUND_END)
    # every hook forwards, so the trainers treat a plug-in as a method of its own step, upload
    # and prediction (sequential only)
    stacked, own_upload, own_predict = False, True, True
    # ``stacks_with_base`` (declared on FedAvg): the plug-in states its own change of the local
    # step in ``client_step_terms`` over its base's, and trains stacked wherever its base does
    # (``trait("stacked", params)``)
    # its step terms also compose over a base whose step is live terms (``client_live_terms``:
    # iCaRL's, GLFC's, LANDER's whole loss): the stacked step differentiates the base's loss,
    # then the plug-in's terms and gradient map follow, as the plug-in's ``client_grad`` follows
    # the base's ``client_step`` on a client alone (FedGP's projection)
    stacks_over_live: bool = False

    @property
    def exchanges(self) -> tuple[str, ...]:  # type: ignore[override]
        """The plug-in's own exchanges and its base's: a plug-in that does not take part in
        one of the base's forwards ``client_reply``/``server_collect`` to the base (the default)."""
        return tuple(dict.fromkeys(self.own_exchanges + self.base.exchanges))

    def client_end(self, ctx: ClientContext) -> Upload:
        """The base's upload; the diagnostics it adds are renamed ``<base>_<key>`` (so a
        base's ``proj_share`` and the plug-in's own stay apart in the metrics columns)."""
        before = set(ctx.stats)
        up = self.base.client_end(ctx)
        for k in [k for k in ctx.stats if k not in before]:
            ctx.stats[f"{self.base.name}_{k}"] = ctx.stats.pop(k)
        return up

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        """The base's round diagnostics, renamed ``<base>_<key>``."""
        return {f"{self.base.name}_{k}": v for k, v in self.base.server_metrics(server, uploads).items()}

    @classmethod
    def client_copies(cls, params: Any = None) -> int:
        """The plug-in's own copies and its base's (FedGP over FedCurv keeps FedCurv's)."""
        if params is None:
            return cls.client_model_copies
        return cls.client_model_copies + METHODS.get(params.base).client_copies(make_params(params.base, dict(params.base_params)))

    @classmethod
    def client_kept_bytes(cls, params: Any, shape: ClientShape) -> int | None:
        """Its base's: a plug-in keeps nothing more per client unless it says so (FedGP's
        own buffer)."""
        return METHODS.get(params.base).client_kept_bytes(make_params(params.base, dict(params.base_params)), shape)

    @classmethod
    def trait(cls, name: str, params: Any = None) -> bool:
        """The plug-in's own trait or its base's: FedGP over joint trains on every task's
        data, over a method that needs a public set it needs one. ``stacked``: the base's, for
        a plug-in that ``stacks_with_base`` (FedGP over FedAvg or FedProx), else False.
        ``capturable_terms``: the plug-in's and its base's (its terms run over the base's)."""
        if name == "capturable_terms":  # its terms run over its base's: both capturable
            if not getattr(cls, name) or params is None:
                return bool(getattr(cls, name))
        elif name == "stacked":  # stacked only over a stacked base, and only if the plug-in says so
            if not cls.stacks_with_base or params is None:
                return False
            base_params = make_params(params.base, dict(params.base_params))
            base = METHODS.get(params.base)
            if base.trait("live_terms", base_params) and (not cls.stacks_over_live or base.trait("sees_step", base_params)):
                return False  # [D] a plug-in's step terms over a base's live terms: composed where it says so
        elif bool(getattr(cls, name)) or params is None:
            return bool(getattr(cls, name))
        base = METHODS.get(params.base)
        return base.trait(name, make_params(params.base, dict(params.base_params)))

    @classmethod
    def table_note(cls, params: dict[str, Any]) -> str:
        """The base method's variant note (a plug-in's own switches are its hyperparameters)."""
        base = params.get("base")
        if base not in METHODS.names():
            return ""
        return METHODS.get(base).table_note(params.get("base_params") or {})

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        """The base method's task-stream requirements are the plug-in's."""
        if params is not None:
            METHODS.get(params.base).check_scenario(scenario, make_params(params.base, dict(params.base_params)))

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        """The base method's model requirements are the plug-in's."""
        if params is not None:
            METHODS.get(params.base).check_model(model, make_params(params.base, dict(params.base_params)), options)

    @classmethod
    def check_train(cls, train, params: Any = None) -> None:
        """The base method's train requirements (e.g. SCAFFOLD's SGD) are the plug-in's,
        checked at config validation like any method's."""
        if params is not None:
            METHODS.get(params.base).check_train(train, make_params(params.base, dict(params.base_params)))


def _forward(name: str):
    def hook(self: OverBase, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.base, name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"The base method's ``{name}`` (``OverBase`` forwards every hook)."
    return hook


for _name in HOOKS:
    if _name not in OverBase.__dict__:  # client_end, server_metrics: written above
        setattr(OverBase, _name, _forward(_name))
