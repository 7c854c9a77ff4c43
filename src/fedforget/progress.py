"""Progress of a training run: a bar on a terminal, one log line per N rounds elsewhere.

Under Snakemake or SLURM a job's stderr goes to a log file; a progress bar there writes
nothing useful until the end (tqdm redraws one line), so without a terminal each
``train.log_every``-th round (and the last) becomes one line of the ``fedforget.progress``
logger: round, global-model test accuracy and loss, mean local training loss, elapsed time.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("fedforget.progress")

BAR, LINES, OFF = "bar", "lines", "off"


def progress_mode(progress: bool | None) -> str:
    """``progress``: None = automatic (a bar on a terminal, log lines otherwise), True = a
    bar, False = nothing."""
    if progress is None:
        return BAR if sys.stderr.isatty() else LINES
    return BAR if progress else OFF


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(v: Any, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


class RoundProgress:
    """Reports rounds ``first..total`` of one run, as a bar or as log lines."""

    def __init__(self, desc: str, first: int, total: int, mode: str, every: int = 1) -> None:
        self.desc, self.total, self.mode, self.every = desc, total, mode, max(1, every)
        self.bar = None
        if mode == BAR:
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=desc, initial=first - 1, total=total)

    def update(self, row: dict[str, Any]) -> None:
        rnd = row["round"]
        acc = row.get("global_model_test_acc")
        if self.bar is not None:
            if acc is not None:
                self.bar.set_postfix_str(f"global acc {_pct(acc)}", refresh=False)
            self.bar.update(1)
        elif self.mode == LINES and (rnd % self.every == 0 or rnd == self.total):
            log.info(
                "%s round %d/%d: global-model test acc %s, test loss %s, local train loss %s, elapsed %.1f s",
                self.desc, rnd, self.total, _pct(acc), _num(row.get("global_model_test_loss")),
                _num(row.get("sampled_clients_local_train_loss_mean")), row.get("elapsed_s") or 0.0,
            )  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
