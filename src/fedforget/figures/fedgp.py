"""FedGP figures drawn from an experiment's runs.

- ``buffer_tasks`` (FedGP Fig. 4): the rows of each task in the clients' replay buffers
  (FedGP's diagnostic ``buffer_task<t>``: the mean over the round's clients) in one round
  (default each run's last), one bar per method (e.g. the buffer policies of Table 9), mean
  ± std over seeds, one panel per dataset x setting. Writes a .csv beside it."""

from __future__ import annotations

import re
from pathlib import Path

from . import FIGURES, FigureInput, method_bars, round_means


@FIGURES.register("buffer_tasks")
def buffer_tasks(inp: FigureInput, out: Path, prefix: str = "fedgp", round: int | None = None) -> list[Path]:
    pat = re.compile(rf"^{re.escape(prefix)}_buffer_task(\d+)$")
    cols = sorted((c for c in inp.metrics.columns if pat.match(c)), key=lambda c: int(pat.match(c).group(1)))
    if not cols:
        inp.require_columns("buffer_tasks", [f"{prefix}_buffer_task0"],
                            " (FedGP records its buffer's rows per task in task streams)")  # fmt: skip
    table = round_means(inp, "buffer_tasks", {c: int(pat.match(c).group(1)) for c in cols}, "task", round)
    which = "the last round" if round is None else f"round {round}"
    return method_bars(table, "task", out, xlabel="task", ylabel="buffer rows of the task\n(mean over clients)",
                       ticks=lambda tasks: [str(t + 1) for t in tasks],
                       title=f"Rows per task in the replay buffers, {which} (FedGP Fig. 4), mean ± std over seeds")  # fmt: skip
