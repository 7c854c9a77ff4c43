"""Scenarios: how a dataset becomes a stream of tasks (the continual track).

A dataset entry of a config may declare ``scenario``; without one the experiment is the
one-task scenario (``kind: none``: one task holding every class, no transform), which is
how every non-continual experiment runs, through the same code path.

    scenario:
      kind: split            # none | split | rotated | permuted | domains
      tasks: 5               # domains: the dataset's number of domains
      classes_per_task: 2    # split: task t holds classes class_order[t*(c-k):t*(c-k)+c]
      class_overlap: 0       # split: k classes shared by neighbouring tasks (FedProTIP Table 15)
      class_order: natural   # split: natural (0, 1, ...) | shuffled (by seed)
      leftover_classes: refuse  # split: refuse | drop the classes beyond tasks x classes_per_task
      incremental: class     # class | task (split);  domain | task (rotated, permuted, domains)
      rounds_per_task: 10    # required for tasks > 1: train.rounds = tasks x rounds_per_task
      rotation: [0, 180]     # rotated: task t's angle ~ U(rotation), in degrees
      interpolation: bilinear  # rotated: bilinear | nearest (the FedGP code's PIL rotate)
      heads: shared          # shared | per_task (one linear head per task, earlier ones frozen)
      boundaries: sync       # sync | {samples_per_window: S, window_rounds: W, unreached: refuse}
      seed: 0                # the scenario's own seed (class order, angles, permutations)

Tasks [P, fedgp.md Sec. 5; fedprotip.md Sec. 5]:
- split: task t is the training and test rows of its classes. ``incremental: class``
  (class-IL) scores every class at test time; ``task`` (task-IL) masks the logits outside
  the task's classes at test time (the task is given at inference) and trains as class-IL,
  bit for bit (``Scenario.masked``; tests/methods/test_task_il.py): a class-IL run's
  task-aware scores are the task-IL run's accuracies (FedGP's configs read them so).
  ``class_overlap: k`` [P, fedprotip.md App. D.6, Table 15]: neighbouring tasks share k
  classes (task t starts k classes before task t-1 ends: 1 shared class gives CIFAR-100 11
  tasks of 10, 2 give 14 tasks of 9). [D] A shared class's rows are in both tasks, training
  and test (a task is the rows of its classes, as without overlap), so a client trains on
  them in both; a per-task partition draws them with the first task that holds them.
  Methods that map each class to one task (replay buffers' task ids, iCaRL's and GLFC's
  class sets, TARGET's, L2P's, CFeD's) declare ``one_task_per_class`` and are refused.
- rotated / permuted (domain-IL): every task holds every row, seen through its transform:
  a rotation by the task's angle (``interpolation``: bilinear [D], or nearest, the FedGP
  code's torchvision ``F.rotate`` of the PIL image [C utils/rotation.py]; zeros outside the
  image), or a fixed pixel permutation of the flattened input. Transforms act on the device after the minibatch
  gather, per row (its task's transform), so a batch may mix tasks (asynchronous
  boundaries). ``incremental: task`` gives the task id at test time (with per-task heads).
- domains (domain-IL over a multi-domain dataset, DomainNet [P, fedprotip.md Sec. 6, App.
  E.1]): task t is the training and test rows of the dataset's t-th domain (its ``domains``
  option order is the task order), every task has every class, no transform; ``tasks``
  must be the number of domains. A row's domain comes from the prepared dataset's meta.json
  (``data.base.domain_ids``) and is passed to ``rows_of_task``.
- Clients: the partition assigns each training row to one client [D]; client k's data in
  task t are its rows in task t. A scheme drawn per class (Dirichlet, shards, classes)
  restricted to a task's classes is that scheme within the task, as FedGP partitions each
  task with Dirichlet; domain-IL clients keep their rows in every task (each client has
  two digits of rotated MNIST in FedGP's setup); with ``domains`` each row is in one task,
  so client k's data in task t are its rows of domain t (a per-class scheme draws its
  client shares once per class over all domains [D]). A client may hold nothing of a task
  (it then does not train while the task runs).
- Boundaries: ``sync`` [P]: every client trains on task t in rounds t*R+1 .. (t+1)*R.
  Asynchronous [P, fedgp.md Table 4]: each client traverses its own stream (its rows of
  task 0, then task 1, ...) at S samples per window of W rounds: in window w it trains on
  stream positions w*S .. (w+1)*S-1 (the last S once the stream is exhausted [D]), whatever
  tasks they come from; its task is that of its newest sample. The server's task (for
  evaluation and the server task hooks) follows the nominal schedule of R rounds per task.
- Randomness is keyed by the scenario seed alone [D]: class order, angles and permutations
  depend on nothing else, never on run order or the training seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..utils import FedForgetError, on_device
from .tasks import covered_classes, scenario_rng, split_classes

KINDS = ("none", "split", "rotated", "permuted", "domains")
SETTINGS = {
    "none": ("class",),
    "split": ("class", "task"),
    "rotated": ("domain", "task"),
    "permuted": ("domain", "task"),
    "domains": ("domain", "task"),
}
DOMAIN_KINDS = ("rotated", "permuted", "domains")  # domain-incremental: every task, every class
HEADS = ("shared", "per_task")
CLASS_ORDERS = ("natural", "shuffled")
# asynchronous boundaries whose windows end before a client's stream does: refuse (an error
# naming the client and the samples_per_window that reaches it) | skip (the stream's tail is
# never trained: every client keeps the configured pace, FedGP Table 4's "exactly 500 samples")
UNREACHED = ("refuse", "skip")
INTERPOLATIONS = ("bilinear", "nearest")  # rotated: grid_sample's mode (the first: the default)
LEFTOVER = ("refuse", "drop")  # split: classes beyond tasks x classes_per_task

DEFAULTS: dict[str, Any] = {
    "kind": "none",
    "tasks": 1,
    "classes_per_task": None,
    "class_order": "natural",
    "incremental": None,  # class for split, domain for rotated / permuted / domains
    "rounds_per_task": None,  # = train.rounds for one task; required for more (check_rounds)
    "rotation": [0.0, 180.0],
    "heads": "shared",
    "boundaries": "sync",
    "seed": 0,
}


# keys a scenario kind reads only some of the time: another kind's would do nothing (and some
# would still enter the run's identity, as the resolved scenario records them)
KIND_KEYS = {"rotation": ("rotated",), "interpolation": ("rotated",), "class_order": ("split",), "heads": KINDS[1:], "boundaries": KINDS[1:]}


def check_kind_keys(raw: Mapping[str, Any], kind: str, key: str) -> None:
    """A config's scenario block ``raw`` sets no key its ``kind`` does not read; ``seed``
    draws a shuffled split's class order, a rotated stream's angles or a permuted one's
    permutations, and nothing else."""
    for k, kinds in KIND_KEYS.items():
        if k in raw and kind not in kinds:
            raise FedForgetError(
                f"{key}.{k} is for kind {' | '.join(kinds)} (kind is '{kind}'), so it would do nothing"
            )
    draws = kind in ("rotated", "permuted") or (kind == "split" and raw.get("class_order") == "shuffled")
    if "seed" in raw and not draws:
        raise FedForgetError(
            f"{key}.seed draws a shuffled split's class order, a rotated stream's angles or a permuted one's "
            f"pixel orders; kind '{kind}'{' with class_order natural' if kind == 'split' else ''} draws nothing, "
            f"so it would do nothing"
        )


def resolve_scenario(
    raw: Mapping[str, Any] | None,
    num_classes: int,
    input_shape: tuple[int, ...],
    key: str,
    domains: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """A config's scenario block with defaults filled in and checked against the dataset
    (one error naming the key, the value and what is allowed); None for no block (the
    one-task scenario). ``domains``: the dataset's domains (``DatasetInfo.domains``)."""
    if not raw:
        return None
    s = {**DEFAULTS, **raw}
    kind = s["kind"]
    if kind not in KINDS:
        raise FedForgetError(f"{key}.kind={kind!r}; allowed: {', '.join(KINDS)}")
    if kind == "none" and s["tasks"] != 1:
        raise FedForgetError(
            f"{key}.tasks={s['tasks']} with kind 'none'; allowed: 1 (or a kind: {', '.join(KINDS[1:])})"
        )
    if kind == "domains":
        if not domains:
            raise FedForgetError(
                f"{key}.kind='domains' needs a dataset with domains (domainnet); this dataset has "
                f"none; allowed kinds here: {', '.join(k for k in KINDS if k != 'domains')}"
            )
        if s["tasks"] != len(domains):
            raise FedForgetError(
                f"{key}.tasks={s['tasks']} with kind 'domains'; allowed: {len(domains)} (one task per "
                f"domain of the dataset: {', '.join(domains)})"
            )
    check_kind_keys(raw, kind, key)
    s["incremental"] = s["incremental"] or SETTINGS[kind][0]
    if s["incremental"] not in SETTINGS[kind]:
        raise FedForgetError(
            f"{key}.incremental={s['incremental']!r} for kind '{kind}'; allowed: {', '.join(SETTINGS[kind])}"
        )
    if kind == "split":
        c = s["classes_per_task"]
        if c is None:
            raise FedForgetError(f"{key}.classes_per_task is required for kind 'split'")
        left = s.get("leftover_classes", "refuse")  # absent from DEFAULTS: old hashes kept [D]
        if left not in LEFTOVER:
            raise FedForgetError(f"{key}.leftover_classes={left!r}; allowed: {' | '.join(LEFTOVER)}")
        k = s.get("class_overlap", 0)  # absent from DEFAULTS, likewise
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < c:
            raise FedForgetError(f"{key}.class_overlap={k!r}; allowed: an integer 0..{c - 1} (below classes_per_task={c})")
        if "class_overlap" in s and k == 0:
            del s["class_overlap"]  # 0 is the default: the same run identity as without the key
        used = covered_classes(s["tasks"], c, k)
        what = f"tasks x classes_per_task = {s['tasks']} x {c}" + (f" with {k} shared by neighbouring tasks" if k else "")
        what += f" = {used}" if not k else f" hold {used} classes, which"
        if used > num_classes:
            raise FedForgetError(
                f"{key}: {what} is more than the dataset's {num_classes} classes; allowed: at most {num_classes}"
            )
        if used < num_classes and left != "drop":
            raise FedForgetError(
                f"{key}: {what} leaves {num_classes - used} of the dataset's {num_classes} classes in no task (never "
                f"trained nor tested); allowed: {num_classes} classes in the tasks, or leftover_classes: drop to leave "
                f"them out on purpose"
            )
    elif s["classes_per_task"] is not None:
        raise FedForgetError(f"{key}.classes_per_task is only for kind 'split' (kind is '{kind}')")
    elif "leftover_classes" in s:
        raise FedForgetError(f"{key}.leftover_classes is only for kind 'split' (kind is '{kind}')")
    elif "class_overlap" in s:
        raise FedForgetError(f"{key}.class_overlap is only for kind 'split' (kind is '{kind}')")
    lo, hi = (float(v) for v in s["rotation"])
    if not (0.0 <= lo <= hi <= 360.0):
        raise FedForgetError(
            f"{key}.rotation={list(s['rotation'])}; allowed: [low, high] with 0 <= low <= high <= 360"
        )
    s["rotation"] = [lo, hi]
    mode = s.get("interpolation", INTERPOLATIONS[0])  # absent from DEFAULTS: old hashes kept [D]
    if mode not in INTERPOLATIONS:
        raise FedForgetError(f"{key}.interpolation={mode!r}; allowed: {', '.join(INTERPOLATIONS)}")
    if mode == INTERPOLATIONS[0]:
        s.pop("interpolation", None)  # the default: the same run identity as without the key
    if kind == "rotated" and len(input_shape) != 3:
        raise FedForgetError(
            f"{key}.kind='rotated' needs images [C, H, W]; the dataset's inputs have shape {list(input_shape)}"
        )
    if s["heads"] not in HEADS:
        raise FedForgetError(f"{key}.heads={s['heads']!r}; allowed: {', '.join(HEADS)}")
    if s["class_order"] not in CLASS_ORDERS:
        raise FedForgetError(
            f"{key}.class_order={s['class_order']!r}; allowed: {', '.join(CLASS_ORDERS)}"
        )
    b = s["boundaries"]
    if b != "sync":
        keys = {"samples_per_window", "window_rounds"}
        if not isinstance(b, Mapping) or not keys <= set(b) <= keys | {"unreached"}:
            raise FedForgetError(
                f"{key}.boundaries={b!r}; allowed: sync | {{samples_per_window: S, window_rounds: W, "
                f"unreached: {' | '.join(UNREACHED)} (optional)}}"
            )
        unreached = b.get("unreached", UNREACHED[0])
        if unreached not in UNREACHED:
            raise FedForgetError(f"{key}.boundaries.unreached={unreached!r}; allowed: {', '.join(UNREACHED)}")
        s["boundaries"] = {k: int(b[k]) for k in sorted(keys)}
        if unreached != UNREACHED[0]:  # absent unless set: the runs before the key keep their hash
            s["boundaries"]["unreached"] = unreached
        if s["heads"] == "per_task":
            raise FedForgetError(
                f"{key}.heads='per_task' needs boundaries: sync (a batch of an asynchronous window mixes tasks)"
            )
    return s


def check_rounds(s: dict[str, Any] | None, rounds: int, key: str) -> None:
    """train.rounds must cover the scenario's tasks: tasks x rounds_per_task, stated for a
    stream of more than one task (without it one task would span every round and the later
    tasks would never train); asynchronous windows must fit in the run."""
    if s is None:
        return
    if s["rounds_per_task"] is None:
        if s["tasks"] > 1:
            t = s["tasks"]
            hint = f" (train.rounds={rounds} / {t} tasks = {rounds // t})" if rounds % t == 0 else ""
            raise FedForgetError(
                f"{key}: rounds_per_task is required for a stream of {t} tasks (without it task 0 would "
                f"take every round); allowed: an integer >= 1 with {t} x rounds_per_task = train.rounds{hint}"
            )
        return
    b = s["boundaries"]
    if b != "sync" and b["window_rounds"] > rounds:
        raise FedForgetError(
            f"{key}: boundaries.window_rounds={b['window_rounds']} is more than train.rounds={rounds}: "
            f"no client would leave its first window; allowed: 1..{rounds}"
        )
    if rounds != s["tasks"] * s["rounds_per_task"]:
        raise FedForgetError(
            f"{key}: train.rounds={rounds}, but the scenario has {s['tasks']} tasks x rounds_per_task "
            f"{s['rounds_per_task']} = {s['tasks'] * s['rounds_per_task']} rounds; allowed: {s['tasks'] * s['rounds_per_task']}"
        )


def has_task_aware_scores(tasks: int, incremental: str | None) -> bool:
    """Whether runs of a stream of ``tasks`` tasks also score each task with its id given
    (tasks.csv's ``task_aware``, ``fedforget.evaluation``): several tasks, scored without
    the id (class- or domain-incremental); a task-IL stream's accuracy is that score."""
    return tasks > 1 and incremental != "task"


@dataclass
class Scenario:
    """A resolved scenario for one run: which rows and classes each task holds, each task's
    transform, the round schedule. ``Scenario.one_task(...)`` is the non-continual case."""

    kind: str
    tasks: int
    incremental: str
    rounds_per_task: int
    task_classes: list[list[int]]
    heads: str
    window: tuple[int, int] | None  # (samples per window, rounds per window); None: sync
    angles: list[float]  # rotated: degrees per task
    perms: torch.Tensor | None  # permuted: [T, D] long
    num_classes: int
    unreached: str = "refuse"  # asynchronous windows that end before a stream does (UNREACHED)
    interpolation: str = "bilinear"  # rotated: how a rotation samples the image (INTERPOLATIONS)

    @classmethod
    def build(
        cls,
        spec: Mapping[str, Any] | None,
        num_classes: int,
        input_shape: tuple[int, ...],
        rounds: int,
    ) -> Scenario:
        s = dict(spec) if spec else {**DEFAULTS, "incremental": "class"}
        t = int(s["tasks"])
        rng = scenario_rng(s["seed"])
        if s["kind"] == "split":
            task_classes = split_classes(t, s["classes_per_task"], s["class_order"], num_classes, rng,
                                         s.get("class_overlap", 0))  # fmt: skip
        else:
            task_classes = [list(range(num_classes)) for _ in range(t)]
        angles = (
            [float(a) for a in rng.uniform(*s["rotation"], size=t)]
            if s["kind"] == "rotated"
            else []
        )
        perms = None
        if s["kind"] == "permuted":
            d = math.prod(input_shape)
            perms = torch.as_tensor(
                np.stack([rng.permutation(d) for _ in range(t)]), dtype=torch.long
            )
        b = s["boundaries"]
        return cls(
            kind=s["kind"], tasks=t, incremental=s["incremental"],
            rounds_per_task=int(s["rounds_per_task"] or rounds), task_classes=task_classes, heads=s["heads"],
            window=None if b == "sync" else (b["samples_per_window"], b["window_rounds"]),
            angles=angles, perms=perms, num_classes=num_classes,
            unreached=UNREACHED[0] if b == "sync" else b.get("unreached", UNREACHED[0]),
            interpolation=s.get("interpolation", INTERPOLATIONS[0]),
        )  # fmt: skip

    # ------------------------------------------------------------------ schedule
    def task_of_round(self, rnd: int) -> int:
        """The server's task in round ``rnd`` (1-based; round 0, before training: task 0)."""
        return min(max(rnd - 1, 0) // self.rounds_per_task, self.tasks - 1)

    def starts_task(self, rnd: int) -> bool:
        return (
            rnd >= 1
            and (rnd - 1) % self.rounds_per_task == 0
            and (rnd - 1) // self.rounds_per_task < self.tasks
        )

    def ends_task(self, rnd: int) -> bool:
        return (
            rnd >= 1
            and rnd % self.rounds_per_task == 0
            and rnd // self.rounds_per_task <= self.tasks
        )

    def window_of_round(self, rnd: int) -> int:
        assert self.window is not None
        return (rnd - 1) // self.window[1]

    def check_windows(self, offsets: list[list[int]], rounds: int) -> None:
        """Asynchronous boundaries must bring every client to each of its tasks: its
        windows cover positions 0 .. windows x samples_per_window - 1 of its stream
        (``ClientData.view``), so a task starting at or after that is never trained. One
        error naming the client, the task and the smallest samples_per_window that reaches
        every client's last task (clients' stream sizes come with the partition, so this is
        checked when a run's data are built, before round 1). ``offsets``: [K][T + 1].
        ``boundaries.unreached: skip`` accepts such streams: their tails are never trained."""
        if self.window is None:
            return
        per, w = self.window
        windows = (rounds - 1) // w + 1
        if self.unreached == "skip":  # the paper's pace kept: a long stream's tail is never trained
            return
        late = [
            (o[t] - o[0], k, t, o[-1] - o[0])
            for k, o in enumerate(offsets)
            for t in range(self.tasks)
            if o[t + 1] > o[t] and o[t] - o[0] >= windows * per
        ]
        if late:
            start, k, t, n = max(late)
            raise FedForgetError(
                f"scenario.boundaries: samples_per_window={per} x {windows} windows (train.rounds={rounds} / "
                f"window_rounds={w}) reach the first {windows * per} rows of a client's stream, but client {k}'s "
                f"task {t} starts at row {start} of its {n} ({len(late)} client task(s) never trained); allowed: "
                f"samples_per_window >= {start // windows + 1}, or fewer window_rounds"
            )

    # ------------------------------------------------------------------ rows and classes
    @property
    def masked(self) -> bool:
        """Task-IL: at test, the scores outside the task's classes are masked (the task id is
        given at inference); training sees every class's logits, as class-IL [P fedgp.md Sec.
        5: "the task identity t is given at inference time"; C FedGP's code (Fed-A-GEM
        models/test.py) scores one class-IL-trained model both ways; METHODS.md "FedGP"].
        Training masked them too before 2026-12-06 (found in review: another experiment, an
        easier one): every task-IL run changed once."""
        return self.incremental == "task" and self.kind == "split"

    @property
    def task_aware(self) -> bool:
        """Evaluation is given the task id (task-IL)."""
        return self.incremental == "task"

    @property
    def scores_task_aware(self) -> bool:
        """Runs of this stream score every task with the task id too (``has_task_aware_scores``)."""
        return has_task_aware_scores(self.tasks, self.incremental)

    @property
    def transforms(self) -> bool:
        return self.kind in ("rotated", "permuted")

    def class_mask(self, device: torch.device) -> torch.Tensor:
        """bool [T, C]: the classes of each task."""
        m = torch.zeros(self.tasks, self.num_classes, dtype=torch.bool)
        for t, cls in enumerate(self.task_classes):
            m[t, cls] = True
        return m.to(device)

    def rows_of_task(self, y: np.ndarray, t: int, domain: np.ndarray | None = None) -> np.ndarray:
        """bool [N]: the rows (of a training or test split with labels ``y`` and, for kind
        domains, each row's domain index ``domain``) in task t."""
        if self.kind == "domains":
            if domain is None or len(domain) != len(y):
                raise FedForgetError(
                    "scenario kind 'domains' needs each row's domain: the prepared dataset's meta.json has "
                    "no 'domains' record (prepared by an older fedforget); delete the prepared folder to prepare it again"
                )
            return np.asarray(domain) == t
        if self.kind != "split":
            return np.ones(len(y), dtype=bool)
        return np.isin(y, self.task_classes[t])

    def _table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The permutations [T, D] (permuted) or the angles [T] in ``dtype`` (rotated) on
        ``device``, copied there once [D]: a copy at every minibatch would be a blocking
        host-to-device copy, which waits for the steps queued on a GPU."""
        permuted = self.kind == "permuted"
        key = (str(device), None if permuted else dtype)
        source = self.perms if permuted else tuple(self.angles)
        cache = self.__dict__.setdefault("_tables", {})  # not a field: no part of ==, repr or pickles
        kept = cache.get(key)
        # a copy of what the scenario holds now (a test replaces the angles): the same tensor
        # (an id could be a freed one's), the same angles
        if kept is None or not (kept[0] is source if permuted else kept[0] == source):
            table = self.perms.to(device) if permuted else torch.as_tensor(self.angles, dtype=dtype, device=device)
            if kept is None:  # lanes copying it at once: the first kept, so none is dropped in use [D]
                kept = cache.setdefault(key, (source, table))
            else:
                cache[key] = kept = (source, table)
        return kept[1]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_tables"}

    def transform(
        self, x: torch.Tensor, task: torch.Tensor | int, fill: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``x`` [..., *input_shape] seen through their tasks' transforms (``task``: one
        task id, or one per row, shaped like x's leading dimensions). A rotation fills the
        corners it uncovers with ``fill`` ([C, 1, 1]: the model input of a black pixel,
        ``InputPipeline.black``; None: 0), as rotating the raw image before its normalisation
        fills them with black [C: FedGP's Rotation transform before ToTensor]: samples of the
        image (``interpolation``) with zeros outside, plus fill times the weight that fell
        outside (with nearest: fill where the sampled pixel is outside)."""
        if not self.transforms:
            return x
        ids = on_device(task, x.device, torch.long)
        n_lead = max(ids.dim(), 1)
        flat = x.reshape(-1, *x.shape[n_lead:])  # [N, *input_shape]
        ids = ids.reshape(-1) if ids.dim() else ids.expand(flat.shape[0])
        table = self._table(x.device, x.dtype)
        if self.kind == "permuted":
            perms = table[ids]  # [N, D]
            out = flat.flatten(1).gather(1, perms).view_as(flat)
        else:
            ang = table[ids] * (math.pi / 180.0)
            cos, sin = torch.cos(ang), torch.sin(ang)
            zero = torch.zeros_like(cos)
            theta = torch.stack(
                [torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1
            )
            grid = F.affine_grid(theta, list(flat.shape), align_corners=False)
            mode = self.interpolation
            out = F.grid_sample(flat, grid, mode=mode, padding_mode="zeros", align_corners=False)
            if fill is not None:
                ones = torch.ones_like(flat[:, :1])
                inside = F.grid_sample(ones, grid, mode=mode, padding_mode="zeros", align_corners=False)
                out = out + fill.to(out.dtype) * (1 - inside)
        return out.reshape(x.shape)
