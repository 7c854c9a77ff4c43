"""The fedforget command line. Every workflow rule calls one of these subcommands; all of
them also work without Snakemake."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .finished import KEPT, drop, keep, restore
from .utils import FedForgetError, first_line, is_out_of_memory

log = logging.getLogger("fedforget")


def _json(text: str | None, what: str):
    if text is None or text == "":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FedForgetError(f"{what}: not valid JSON ({e}): {text!r}") from None


def cmd_list(args) -> None:
    if args.cmd == "datasets":
        from .data import DATASETS as reg
    elif args.cmd == "methods":
        from .methods import METHODS as reg
    elif args.cmd == "models":
        from .models import MODELS as reg
    elif args.cmd == "figures":
        from .figures import FIGURES as reg
    else:
        from .partition import PARTITIONERS as reg
    print("\n".join(reg.names()))


def cmd_reference(args) -> None:
    from .reference import reference_markdown

    print(reference_markdown(), end="")


def cmd_validate(args) -> None:
    from .parse import client_state_sizes, dataset_sizes, load_config, model_sizes
    from .pipeline import describe

    wf = load_config(args.config)
    print(f"{args.config}: valid")
    print(describe(wf))
    print("datasets (sizes known before they are built):")
    print("\n".join(dataset_sizes(wf)))
    print("models (parameters counted without building them):")
    print("\n".join(model_sizes(wf)))
    kept = client_state_sizes(wf)
    if kept:
        print("what clients keep across rounds (model copies; replay rows, exemplars, bases or class reports at their fullest), in "
              "host memory per job (its resource client_state_mb: jobs packed in a submission run at once only as "
              "many as fit its mem_mb):")
        print("\n".join(kept))


def cmd_prepare(args) -> None:
    from .data import prepare_dataset, prepare_public

    if args.config:
        from .parse import load_config
        from .pipeline import prepare_all

        for p in prepare_all([load_config(c) for c in args.config], args.raw_dir, args.download):
            print(p)
        return
    if args.public:
        if not args.of:
            raise FedForgetError(
                "prepare --public needs --of DATASET_ID (the private dataset it is held out of)"
            )
        print(prepare_public(_json(args.public, "--public"), args.of, args.root))
        return
    if not args.dataset:
        raise FedForgetError(
            "prepare needs --dataset NAME, --public SPEC --of ID, or --config FILE"
        )
    opts = _json(args.options, "--options") or {}
    print(prepare_dataset(args.dataset, opts, args.root, args.raw_dir, args.download))


def cmd_partition(args) -> None:
    from .config import DatasetSpec
    from .partition import PartitionSpec
    from .pipeline import partition_one

    if args.config:
        from .parse import load_config  # the whole config's validation: the methods, torch

        wf = load_config(args.config)
        seen = set()
        for rc in wf.runs():
            if rc.partition_dir not in seen:
                seen.add(rc.partition_dir)
                print(partition_one(rc.dataset, rc.partition, wf.data_dir, rc.partition_dir))
        return
    if not (args.dataset and args.spec and args.out):
        raise FedForgetError("partition needs --dataset, --spec and --out (or --config FILE)")
    from .data import dataset_id

    opts = _json(args.options, "--options") or {}
    ds = DatasetSpec(
        args.dataset, opts, "", {}, _json(args.public, "--public"), dataset_id(args.dataset, opts)
    )
    print(partition_one(ds, PartitionSpec(**_json(args.spec, "--spec")), args.root, args.out))


# torch.optim's methods that torch wraps in torch._disable_dynamo (torch/optim/optimizer.py)
OPTIMIZER_DYNAMO_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def skip_dynamo_import() -> None:
    """[D] Keep a training process from importing ``torch._dynamo``. torch wraps the
    ``torch.optim.Optimizer`` methods of OPTIMIZER_DYNAMO_WRAPPED in ``torch._disable_dynamo``,
    whose first call imports torch._dynamo (about 3 s on 2 cores, near half the start of a
    small training job) only to build a variant of the method that differs from it while
    torch.compile traces; it caches that variant on the method as ``__dynamo_disable``.
    fedforget compiles nothing, so the training commands (``train``, ``run``) store the method
    itself there before any optimizer exists: a job on the batched trainer (the default
    where a method allows it), which never calls ``Optimizer.step``, then does not import
    torch._dynamo, with the same result bytes (tests/test_cli.py), where torch.func does not
    import it itself (torch 2.5's ``grad_and_value`` does; 2.11's does not). A job on the sequential
    trainer still imports it at its first step (torch's ``step`` wrapper imports it at every
    call). Only the command line does this: a program that imports fedforget keeps torch as
    it is. Nothing is changed where torch._dynamo is already imported or a method is not
    wrapped so (another torch)."""
    import torch

    if "torch._dynamo" in sys.modules:
        return
    for name in OPTIMIZER_DYNAMO_WRAPPED:
        plain = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
        if plain is not None and getattr(plain, "__dynamo_disable", None) is None:
            setattr(plain, "__dynamo_disable", plain)  # what torch would cache, outside tracing


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have the C library keep host memory the process frees, for its next allocations [D]:
    with glibc, no block mapped on its own (M_MMAP_MAX 0) and no heap trimming below 2 GB
    (M_TRIM_THRESHOLD); True where that was set, False elsewhere (another C library:
    nothing changed). glibc serves each block above its mmap threshold (at most 32 MB) with
    fresh pages and hands them back when it is freed, so a CPU step whose activations are
    such blocks (a transformer's attention scores) page-faults on every 4 KB of them at
    every step. Process-wide, so here, in the command line's module: ``fedforget train``
    calls it, one process per training job (not the training code's: results are the same
    bits, torch aligning its buffers to 64 bytes either way, tests/test_cli.py, and the code
    digest of every run stays). A process's peak memory can grow (a stacked TinyBERT's by a
    third: docs/benchmarks.md, its CPU rates with ``--malloc keep`` and ``default``)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def cmd_train(args) -> None:
    from .config import RunConfig, load_run_config
    from .runner import run_training

    skip_dynamo_import()

    if args.config_json:
        rc = RunConfig.from_dict(_json(args.config_json, "--config-json"))
    elif args.config:
        rc = load_run_config(args.config)
    else:
        raise FedForgetError(
            "train needs --config FILE (a run config or run.json) or --config-json"
        )
    if args.threads is not None:
        from dataclasses import replace

        rc = replace(rc, train=replace(rc.train, threads=args.threads))
    out = args.out or rc.run_dir
    if not args.fresh:  # the same run finished here before (fedforget.finished: Snakemake's groups)
        import torch

        from .engine import resolve_device

        threads = rc.train.threads if rc.train.threads > 0 else torch.get_num_threads()
        device = resolve_device(rc.train.device)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        rec = restore(rc, out, device.type, threads, gpu)
        if rec is not None:
            print(
                f"{rec['status']} (not trained again: the outputs of this run, finished at {rec.get('finished_at')}, "
                f"put back from {out}/{KEPT}; --fresh or deleting {out} trains it again): "
                f"final global-model test accuracy {rec.get('final_global_model_test_acc')}"
            )
            return
    drop(out)
    keep_freed_memory()  # this process is the job's: its host memory kept for its next steps
    rec = run_training(rc, out, progress=None, resume=not args.fresh)
    keep(rc, out)
    print(
        f"{rec['status']}: final global-model test accuracy {rec.get('final_global_model_test_acc')}"
    )


def cmd_stale(args) -> None:
    """Finished runs of a config that no longer stand for its config or the current code."""
    from .parse import load_config
    from .provenance import stale_reasons

    wf = load_config(args.config)
    runs = wf.runs()
    n_stale = 0
    for rc in runs:
        reasons = stale_reasons(rc)
        n_stale += bool(reasons)
        if reasons or args.all:
            print(f"{rc.run_dir}\t{'stale: ' + '; '.join(reasons) if reasons else 'current'}")
    print(f"{n_stale} of {len(runs)} runs stale", file=sys.stderr)


def cmd_plan(args) -> None:
    from .parse import load_config

    wf = load_config(args.config)
    for rc in wf.runs():
        if args.write:
            from .utils import atomic_write_json

            atomic_write_json(rc.run_dir / "config.json", rc.to_dict())
        print(rc.run_dir)


def cmd_aggregate(args) -> None:
    from .aggregate import aggregate

    if args.config:
        from .parse import load_config
        from .pipeline import experiment_run_dirs, summary_dir

        wf = load_config(args.config)
        for exp in wf.experiments:
            aggregate(
                experiment_run_dirs(wf, exp),
                summary_dir(wf, exp.name),
                exp.name,
                exp.paper,
                wf.paper_results,
            )
            print(summary_dir(wf, exp.name))
        return
    if not (args.runs and args.out and args.experiment):
        raise FedForgetError(
            "aggregate needs --runs DIR... --out DIR --experiment NAME (or --config FILE)"
        )
    aggregate(
        args.runs, args.out, args.experiment, _json(args.paper, "--paper"), args.paper_results
    )
    print(args.out)


def cmd_paper_table(args) -> None:
    from .paper_tables import write_paper_tables

    for p in write_paper_tables(args.summary, args.experiment, _json(args.paper, "--paper"), args.paper_results):
        print(p)


def cmd_plot(args) -> None:
    from .plots import plot_experiment

    curves = [c for c in args.curves.split(",") if c] if args.curves is not None else None
    for p in plot_experiment(args.summary, args.out, curves, continual=not args.curves_only):
        print(p)


def cmd_figure(args) -> None:
    from .figures import make_figure

    for p in make_figure(args.name, args.summary, args.experiment, args.out, _json(args.options, "--options")):
        print(p)


def cmd_run(args) -> None:
    from .parse import load_config
    from .pipeline import run_all

    wf = load_config(args.config)
    skip_dynamo_import()
    for name, table in run_all(wf, force=args.force).items():
        print(f"== {name}")
        print(
            table[
                [
                    "dataset",
                    "setting",
                    "method",
                    "final_acc_mean",
                    "final_acc_std",
                    "n_seeds",
                    "status",
                ]
            ].to_string(index=False)
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedforget", description=__doc__)
    p.add_argument("--version", action="version", version=f"fedforget {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (default: warnings, and a training job's progress)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, what in (
        ("datasets", "datasets"),
        ("methods", "federated methods"),
        ("models", "models"),
        ("partitioners", "partition schemes"),
        ("figures", "experiment figures"),
    ):
        sub.add_parser(name, help=f"list registered {what}, one per line").set_defaults(fn=cmd_list)

    sub.add_parser(
        "reference", help="print the configuration reference: every key, what it allows, its default (docs/reference.md)"
    ).set_defaults(fn=cmd_reference)

    s = sub.add_parser("validate", help="validate a workflow config and count its jobs")
    s.add_argument("--config", required=True, help="workflow config (YAML), e.g. config/config.yaml")
    s.set_defaults(fn=cmd_validate)

    s = sub.add_parser("prepare", help="build datasets / public sets into the prepared format")
    s.add_argument(
        "--config", action="append",
        help="prepare everything a workflow config uses (repeat for several; each dataset once; "
        "files whose bytes are unchanged are left as they are)",
    )  # fmt: skip
    s.add_argument("--dataset", help="a registered dataset name")
    s.add_argument("--options", help="dataset options as JSON, e.g. '{\"pca\": 2}'")
    s.add_argument("--public", help="held-out public set spec as JSON")
    s.add_argument("--of", help="private dataset id the public slice is held out of")
    s.add_argument("--root", default="data", help="prepared-data directory (default: data)")
    s.add_argument(
        "--raw-dir",
        help="native files of the paper datasets, <raw-dir>/<source>/ (default: <root>/raw); "
        "a location only: no part of any dataset id",
    )  # fmt: skip
    s.add_argument(
        "--download", action="store_true",
        help="fetch missing native files from their sources, checksummed (the workflow's "
        "config key `download: true`); default: a missing file is an error saying how to get it",
    )  # fmt: skip
    s.set_defaults(fn=cmd_prepare)

    s = sub.add_parser("partition", help="split a dataset's private pool over clients")
    s.add_argument("--config", help="write every partition a workflow config uses")
    s.add_argument("--dataset", help="a registered dataset name")
    s.add_argument("--options", help="dataset options as JSON")
    s.add_argument("--public", help="public spec as JSON (a holdout is excluded from the pool)")
    s.add_argument("--spec", help="partition spec as JSON, e.g. '{\"scheme\": \"iid\", \"clients\": 10}'")
    s.add_argument("--out", help="output directory (assignment.npy, class_counts.csv, heatmap.png, meta.json)")
    s.add_argument("--root", default="data", help="prepared-data directory (default: data)")
    s.set_defaults(fn=cmd_partition)

    s = sub.add_parser("train", help="run one federated training job")
    s.add_argument("--config", help="run config (YAML/JSON) or a previous run.json")
    s.add_argument("--config-json", help="run config as a JSON string")
    s.add_argument("--out", help="output directory (default: the run's directory under results/)")
    s.add_argument("--threads", type=int, help="torch CPU threads (overrides train.threads)")
    s.add_argument(
        "--fresh", action="store_true",
        help="train from round 0: ignore a checkpoint left by an interrupted run (default: resume) and the outputs "
        "kept from a finished run of the same config and code (default: put back, fedforget.finished)",
    )  # fmt: skip
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("plan", help="list (and with --write, write) every job's run config")
    s.add_argument("--config", required=True, help="workflow config (YAML)")
    s.add_argument("--write", action="store_true", help="write each job's config.json into its run directory")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser(
        "stale", help="list the runs of a config that are missing or were made by another config or code"
    )
    s.add_argument("--config", required=True, help="workflow config (YAML)")
    s.add_argument("--all", action="store_true", help="list current runs too")
    s.set_defaults(fn=cmd_stale)

    s = sub.add_parser("aggregate", help="tables over seeds for an experiment")
    s.add_argument("--config", help="aggregate every experiment of a workflow config")
    s.add_argument("--runs", nargs="+", help="run directories (each with run.json and metrics.csv)")
    s.add_argument("--out", help="summary directory (table.csv, table.md, runs.csv, metrics.parquet)")
    s.add_argument("--experiment", help="the experiment's name (table title)")
    s.add_argument("--paper", help="paper link as JSON: {name, table, dataset_map, setting_map, method_map}")
    s.add_argument(
        "--paper-results", default="config/paper_results.csv",
        help="the papers' numbers (CSV) read when --paper links a table (default: config/paper_results.csv)",
    )  # fmt: skip
    s.set_defaults(fn=cmd_aggregate)

    s = sub.add_parser("paper-table", help="the linked paper table beside ours, in the paper's layout")
    s.add_argument("--summary", required=True, help="the experiment's summary directory (runs.csv; writes paper.csv/.md/.html)")
    s.add_argument("--experiment", required=True, help="the experiment's name (page title)")
    s.add_argument("--paper", required=True, help="paper link as JSON: {name, table, dataset_map, setting_map, method_map}")
    s.add_argument(
        "--paper-results", default="config/paper_results.csv",
        help="the papers' numbers (CSV; default: config/paper_results.csv)",
    )  # fmt: skip
    s.set_defaults(fn=cmd_paper_table)

    s = sub.add_parser("plot", help="learning curves from an experiment's summary")
    s.add_argument("--summary", required=True, help="the experiment's summary directory (metrics.parquet)")
    s.add_argument("--out", required=True, help="output directory for the PNGs")
    s.add_argument("--curves", help="comma-separated learning curves to draw (default: every one)")
    s.add_argument("--curves-only", action="store_true", help="draw the learning curves alone, no continual figures")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("figure", help="draw one experiment-specific figure (fedforget.figures)")
    s.add_argument("--summary", required=True, help="the experiment's summary directory")
    s.add_argument("--experiment", required=True, help="the experiment's name (as in its runs)")
    s.add_argument("--name", required=True, help="a registered figure")
    s.add_argument("--options", help="the figure's options as JSON")
    s.add_argument("--out", required=True, help="output .png")
    s.set_defaults(fn=cmd_figure)

    s = sub.add_parser("run", help="the whole pipeline in-process, without Snakemake")
    s.add_argument("--config", required=True, help="workflow config (YAML)")
    s.add_argument("--force", action="store_true", help="redo every step, finished runs included")
    s.set_defaults(fn=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("fedforget.progress").setLevel(logging.INFO)  # a job's progress lines
    try:
        args.fn(args)
    except FedForgetError as e:
        print(f"fedforget: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that does not exist or cannot be read, named by the OS
        print(f"fedforget: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except Exception as e:  # out of memory in any command, as is_out_of_memory tells (a training job's says more: runner)
        if not is_out_of_memory(e):
            raise
        first = first_line(e)
        print(f"fedforget: error: fedforget {args.cmd} ran out of memory: {first}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
