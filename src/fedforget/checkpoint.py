"""Checkpoints of a run: its ``FedState`` (``fedforget.state``: global weights, the
method's server and per-client state, task progress, the metrics so far, the global RNG
states) with the format and config hash, how it is put back, and when it is written
(``CheckpointCadence``: ``train.checkpoint_every``). The runner writes them atomically; a
resumed run equals an uninterrupted one byte for byte on a CPU."""

from __future__ import annotations

import logging
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .config import RunConfig
from .state import FedState
from .utils import FedForgetError

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 3  # 2: the scenario's progress (tasks); 3: Summed shares in waiting task reports
CHECKPOINT = "checkpoint.pt"  # in the run directory while the run is unfinished
CODE_DIGEST = "code_digest"  # the checkpoint's record of the code that computed it (run.json's)
AUTO_CHECKPOINT_RATIO = 10  # checkpoint_every auto: training time between writes >= 10 x a write [D]


class CheckpointCadence:
    """After which rounds a run writes its checkpoint (``train.checkpoint_every``): after
    every ``every``-th round; or, with ``"auto"`` [D], after the run's first round and then
    after each round that ends at least ``AUTO_CHECKPOINT_RATIO`` times the last write's
    duration after that write ended. Each later write then takes at most 1 / (1 + ratio)
    (about 9 %) of the time from the end of the one before to its own end, whatever a
    checkpoint weighs (a model copy per client for SCAFFOLD, three for FedCurv:
    ``benchmarks/checkpoint_cost.py``), and a kill loses at most ratio x the write time plus
    one round; a cheap checkpoint is written every round. Never after the last round
    (``rounds``): the run's outputs supersede it. The rounds written depend on wall time,
    the results do not: a resume equals the uninterrupted run. ``written`` and ``write_s``
    count this process's writes (run.json: checkpoints_written, checkpoint_write_s);
    ``clock`` is for tests."""

    def __init__(self, every: int | str, rounds: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.every, self.rounds, self.clock = every, rounds, clock
        self.written, self.write_s = 0, 0.0
        self.last_s = self.ended = 0.0  # the last write's duration and its end

    def due(self, rnd: int) -> bool:
        """Whether the checkpoint after round ``rnd`` is written."""
        if not 0 < rnd < self.rounds:
            return False
        if self.every != "auto":
            return rnd % self.every == 0
        return not self.written or self.clock() - self.ended >= AUTO_CHECKPOINT_RATIO * self.last_s

    def write(self, save: Callable[[], None]) -> None:
        """Run ``save`` (the checkpoint's construction and write) and time it."""
        t0 = self.clock()
        save()
        self.ended = self.clock()
        self.last_s = self.ended - t0
        self.written += 1
        self.write_s += self.last_s


def checkpoint_of(fed: FedState, config_hash: str, client_threads: int | None = None,
                  client_engine: str | None = None, group: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The checkpoint of a run after its round ``fed.round``: ``fed.state_dict()`` with the
    format, the config hash it belongs to and the number of torch threads that computed it,
    and that each client trained on (``client_threads``, default the same; fewer where the
    sequential trainer trains clients at once) (CPU results depend on them:
    ``resume_threads``, ``check_client_threads``), and the client engine that trained its
    clients (``check_client_engine``) and, batched, the most clients a group held
    (``group``: train.max_parallel_clients, ``check_client_group``). The runner adds the
    digest of the code that computed it (``CODE_DIGEST``, ``load_checkpoint``)."""
    threads = torch.get_num_threads()
    out = {
        "format": CHECKPOINT_FORMAT, "config_hash": config_hash, "torch_threads": threads,
        "client_threads": client_threads or threads, **fed.state_dict(),
    }  # fmt: skip
    if client_engine is not None:
        out["client_engine"] = client_engine
    if group is not None:
        out["max_parallel_clients"] = group
    return out


def check_client_group(ckpt: dict[str, Any], now: int) -> None:
    """Refuse to resume batched training with groups of another size (``now``:
    ``train.max_parallel_clients``) than the checkpoint's rounds had [D]: the groups' sums run
    in another order, so the resumed run would equal neither uninterrupted one (the logged
    local loss moved in its 8th digit; a runtime setting, outside the run's identity). A
    checkpoint written before the record loads."""
    had = ckpt.get("max_parallel_clients")
    if had is not None and had != now:
        raise FedForgetError(
            f"checkpoint's clients were trained in batched groups of at most {had} (train.max_parallel_clients); this "
            f"run would group {now}: the sums run in another order, so it would equal neither uninterrupted run; "
            f"resume with train.max_parallel_clients: {had}, or delete the checkpoint to start this run over"
        )


def check_client_engine(ckpt: dict[str, Any], now: str) -> None:
    """Refuse to resume with another client engine (``now``) than the one that trained the
    checkpoint's rounds [D]: the engines agree within 1e-5, not byte for byte, so the
    resumed run would equal neither uninterrupted one (``client_engine`` is a runtime
    setting, outside the run's identity). A checkpoint written before the record loads."""
    had = ckpt.get("client_engine")
    if had is not None and had != now:
        raise FedForgetError(
            f"checkpoint's clients were trained by client engine '{had}'; this run would train them by '{now}': "
            "the two agree within 1e-5, not byte for byte; resume with train.client_engine: "
            f"{had}, or delete the checkpoint to start this run over"
        )


def check_client_threads(ckpt: dict[str, Any], now: int, concurrent: int) -> None:
    """Refuse to resume on a CPU where each client would train on another number of threads
    (``now``, under ``train.concurrent_clients`` = ``concurrent``) than the checkpoint's
    clients did (the summation order, as in ``resume_threads``) [D]."""
    had = ckpt.get("client_threads")
    if had is not None and had != now:
        raise FedForgetError(
            f"checkpoint's clients trained on {had} torch threads each; with train.concurrent_clients: "
            f"{concurrent} on {torch.get_num_threads()} threads they would train on {now}: results on a CPU "
            "depend on the count; resume with the concurrent_clients it ran with, or delete the checkpoint to "
            "start this run over"
        )


def resume_threads(ckpt: dict[str, Any], asked: int) -> int | None:
    """The torch thread count a run must continue on from ``ckpt`` [D]: on a CPU the bytes of a
    result depend on it (summation order; measured: 1 vs 2 threads changes a ResNet-8 run's
    weights), so a resumed run keeps the count the checkpoint was computed with. ``asked``:
    ``train.threads`` (0: left to the environment, which then yields to the checkpoint).
    None where nothing needs to change (or the checkpoint predates the record); an error
    where the config asks for another count."""
    had = ckpt.get("torch_threads")
    if had is None or had == torch.get_num_threads():
        return None
    if asked and asked != had:
        raise FedForgetError(
            f"checkpoint was computed on {had} torch threads and train.threads asks for {asked}: results on a "
            f"CPU depend on the thread count; resume with train.threads: {had}, or delete the checkpoint to "
            "start this run over"
        )
    return had


def format2_changes(cfg: RunConfig) -> list[str]:
    """What of run ``cfg`` computes otherwise since checkpoint format 3 (2026-12-06): a
    format 2 checkpoint of such a run would continue another computation than it began."""
    sc, changes = cfg.dataset.scenario or {}, []
    if sc.get("incremental") == "task" and sc.get("kind") == "split":
        changes.append("task-IL trains unmasked")
    if sc.get("heads") == "per_task":
        changes.append("per-task heads: the server's and frozen models' heads")
    if sc.get("boundaries", "sync") != "sync":
        changes.append("asynchronous boundaries: passed-over tasks ended")
    if cfg.train.precision == "bf16":
        changes.append("bf16: step terms and similarities in fp32")
    return changes


def restore(fed: FedState, ckpt: dict[str, Any], config_hash: str, changed: Sequence[str] = ()) -> None:
    """Put a checkpoint into ``fed`` (checked: format, config hash, parameter keys). A
    format 2 checkpoint loads where it holds no waiting task reports, the one part whose
    layout format 3 changed (FOT's and FedProTIP's sketches became ``Summed`` shares), and
    where nothing the run computes changed with format 3 (``changed``: ``format2_changes``)
    [D]: otherwise the run is refused here, not at its task end rounds later, nor continued
    as another computation than it began."""
    fmt = ckpt.get("format")
    if fmt not in (2, CHECKPOINT_FORMAT):
        raise FedForgetError(f"checkpoint format {fmt!r}; this fedforget reads 2 and {CHECKPOINT_FORMAT}")
    waiting = (ckpt.get("tasks") or {}).get("reports") or {}
    if fmt == 2 and waiting:
        raise FedForgetError(
            f"checkpoint format 2 holds the task reports of clients {sorted(waiting)} (asynchronous task "
            f"boundaries), written before format {CHECKPOINT_FORMAT} changed their layout (Summed sketch shares); "
            "finish the run with the fedforget that wrote it, or delete the checkpoint to start this run over"
        )
    if fmt == 2 and changed:
        raise FedForgetError(
            f"checkpoint format 2 was written by a fedforget that computed this run otherwise ({'; '.join(changed)}, "
            f"since format {CHECKPOINT_FORMAT}); finish the run with the fedforget that wrote it, or delete the "
            "checkpoint to start this run over"
        )
    if ckpt["config_hash"] != config_hash:
        raise FedForgetError(
            f"checkpoint is of config {ckpt['config_hash'][:12]}, not this run's {config_hash[:12]}"
        )
    if ckpt["global_params"].keys() != fed.global_params.keys():
        raise FedForgetError("checkpoint weights do not match the model's parameters")
    fed.load_state_dict(ckpt)


def load_checkpoint(
    path: Path, cfg: RunConfig, device: torch.device, code_digest: str | None = None
) -> dict[str, Any] | None:
    """The run's checkpoint, or None if there is none or it belongs to another config (a
    stale file from before the config changed: removed, the run starts over), or, where
    ``code_digest`` is given, was computed by other code (``CODE_DIGEST``: the digest of the
    source the run executes, ``fedforget.provenance.training_code``; the same rule [D]: a
    result is a function of its config and code, and a resumed run would be neither the old
    code's nor the new's; a checkpoint written before the record loads)."""
    if not path.exists():
        return None
    try:
        check_crc(path)
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling error means a damaged file
        raise FedForgetError(
            f"checkpoint {path} cannot be read: {why_unreadable(path, e)}; delete it to start this run over"
        ) from None
    if not isinstance(ckpt, dict) or "config_hash" not in ckpt:
        raise FedForgetError(f"checkpoint {path} is not a fedforget checkpoint; delete it to start this run over")
    if ckpt["config_hash"] != cfg.hash:
        log.warning("%s: checkpoint of another config (%s), starting over", path, ckpt["config_hash"][:12])
        path.unlink()
        return None
    had = ckpt.get(CODE_DIGEST)
    if code_digest is not None and had is not None and had != code_digest:
        log.warning("%s: checkpoint computed by other code (%s, now %s), starting over", path, had[:12], code_digest[:12])
        path.unlink()
        return None
    return ckpt


class DamagedArchive(Exception):
    """A member of a checkpoint's zip archive whose bytes are not those written."""


def check_crc(path: Path) -> None:
    """Raise ``DamagedArchive`` if a member of checkpoint ``path`` (a zip archive, the format
    ``torch.save`` writes) fails its CRC-32. [D] ``torch.load`` does not check these: a
    flipped bit in a tensor's bytes loads, and the run would resume from weights it never
    had. Reading the file once more costs little beside a resume; a file that is no zip
    archive (truncated, or another format) is left to ``torch.load`` and its error."""
    if not zipfile.is_zipfile(path):
        return
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.CRC == 0 and info.file_size:  # written without CRCs (torch's compute_crc32 off)
                continue
            try:
                with z.open(info) as f:
                    while f.read(1 << 24):
                        pass
            except (zipfile.BadZipFile, UnicodeDecodeError) as e:  # a bad CRC or a mangled header
                raise DamagedArchive(f"its part {info.filename} is not as written ({e})") from None


def why_unreadable(path: Path, error: BaseException) -> str:
    """Why ``torch.load`` could not read checkpoint ``path`` (it raised ``error``), in a few
    words. [D] A truncated file (a copy or a disk cut short; the runner's own writes are
    atomic) is named as such: torch's own words for it are an ``OSError`` "Invalid
    argument" or a paragraph from its zip reader, which say neither what is wrong nor what
    to do. The format torch writes is a zip archive, whose directory is at its end, so a
    file that begins as one but has no readable end is truncated. Any other error keeps
    its type and the first line of its message (a damaged file: wrong bytes, not missing
    ones)."""
    if isinstance(error, DamagedArchive):
        return f"it is damaged: {error}"
    size = path.stat().st_size
    if size == 0:
        return "it is empty (0 bytes)"
    with path.open("rb") as f:
        zip_start = f.read(4) == b"PK\x03\x04"
    if (zip_start and not zipfile.is_zipfile(path)) or isinstance(error, EOFError):
        return f"it is truncated ({size} bytes, its end is missing)"
    first = (str(error).strip().splitlines() or [""])[0].split(". ")[0]  # not torch's advice
    return f"{type(error).__name__}: {first[:200]}"
