# Helpers: the config is validated once here, at parse time (schema + registries + sizes),
# before any job starts, and expanded into lookup tables that the rules read by wildcard.
import json
import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import update_config

from fedforget.config import load_yaml, typed_overrides, yaml12_floats
from fedforget.continual import CONTINUAL_OUTPUTS, scenario_shape
from fedforget.data import DATASETS
from fedforget.data.base import corrupt_files
from fedforget.finished import STOPPED, set_aside_stopped
from fedforget.parsecache import parse_workflow, training_key
from fedforget.partition import corrupt_partition
from fedforget.pipeline import parse_only
from fedforget.plots import CONTINUAL_DIR, CONTINUAL_FIGURES, CURVE_NEEDS, CURVES, experiment_curves
from fedforget.provenance import BYTES, kept_digest, module_code, threads_differ
from fedforget.utils import FedForgetError, atomic_write_json, canonical_json

# ----------------------------------------------------------------------------- config
# validated (parse.parse_config) with the training jobs' code digests, or both loaded from
# the cache of an earlier parse of the same config and package source (fedforget.parsecache:
# a start without importing torch). A nested --config value (smoke={rounds: 3}) reaches us
# with its scalars as strings: they get their YAML types first (config.typed_overrides).
typed_overrides(config, dict(workflow.config_settings.config))
try:
    _files = {}  # Snakemake's YAML load keeps a repeated key's last value; ours refuses it, and reads 5e-2 as a number
    for _file in dict.fromkeys(workflow.configfiles):
        update_config(_files, load_yaml(_file))
    yaml12_floats(config, _files)
    WF, DIGESTS = parse_workflow(config, create=True)  # cached from the first start on
except FedForgetError as err:
    raise WorkflowError(f"fedforget: {err}") from None

DATA = WF.data_dir
RESULTS = WF.results_dir
try:  # --config only=EXPERIMENT[/METHOD[/SEED]]: part of the file (targets only)
    ONLY = parse_only(WF, config.get("only"))
except FedForgetError as err:
    raise WorkflowError(f"fedforget: {err}") from None

RUNS = {
    (rc.experiment, rc.dataset.label, rc.partition.slug, rc.method.label, str(rc.seed)): rc
    for rc in WF.runs()
}
RUN_DIRS = {key: str(rc.run_dir) for key, rc in RUNS.items()}
# a run that stopped before its end outside Snakemake (its run.json still running or failed, no
# process on it) has its run.json set aside, so that this invocation trains it again
_moved, _unknown = set_aside_stopped(RUN_DIRS.values())
for _d in _moved:
    print(f"fedforget: {_d} stopped before its end (run.json not completed, no process in it): its run.json is "
          f"now {STOPPED}, and the run trains again (from its checkpoint where one is left)", file=sys.stderr)
if _unknown:
    print(f"fedforget: {len(_unknown)} run(s) have a run.json that is not completed, and their file system has no "
          f"locks to tell whether a process still runs them ({_unknown[0]} ...): delete the run.json of those "
          "that stopped to train them again", file=sys.stderr)
# each run's resolved config (JSON), hash and client_state_mb, computed once per parse (parsecache: "runs")
RUN_CONFIGS = DIGESTS["runs"]
PARTITIONS = {(rc.dataset.pool_id, rc.partition.slug): rc for rc in RUNS.values()}
PREPARE = WF.datasets_to_prepare()
HOLDOUTS = WF.holdouts_to_prepare()


wildcard_constraints:
    dataset=r"[^/]+",
    public=r"[^/]+",
    pool=r"[^/]+",
    partition=r"[^/]+",
    experiment=r"[^/]+",
    method=r"[^/]+",
    seed=r"\d+",


def run_key(w):
    return (w.experiment, w.dataset, w.partition, w.method, w.seed)


DATASET_FILES = ("x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy", "meta.json")  # rule prepare_dataset's
PUBLIC_FILES = ("x.npy", "y.npy", "indices.npy", "meta.json")  # rule prepare_public's


def dataset_files(did):
    return [f"{DATA}/{did}/{f}" for f in DATASET_FILES]


def public_files(pid):
    return [f"{DATA}/public/{pid}/{f}" for f in PUBLIC_FILES]


def data_inputs(ds):
    """Prepared files a job reads for a dataset spec: the dataset and its public set."""
    out = dataset_files(ds.id)
    if ds.public:
        out += public_files(ds.public_id) if ds.public["source"] == "holdout" else dataset_files(ds.public_id)
    return out


def check_prepared_data():
    """At parse time, before any job: every prepared file the config uses that exists must
    match the sha256 in its meta.json, else one error names each such file and how to get
    it back. A missing prepared file is a target (all_targets), so its preparation runs
    again. Hashes of files over 64 MiB are cached by (size, mtime) in
    .snakemake/fedforget/verified.json (data.base.corrupt_files)."""
    cache_path = Path(".snakemake/fedforget/verified.json")
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    dirs = [Path(DATA) / did for did in PREPARE] + [Path(DATA) / "public" / pid for pid in HOLDOUTS]
    problems = [p for d in dirs for p in corrupt_files(d, cache)]
    if problems:
        raise WorkflowError("fedforget: prepared data do not match their checksums:\n  " + "\n  ".join(problems))
    if cache and Path(".snakemake").is_dir():
        atomic_write_json(cache_path, cache)


check_prepared_data()


def check_partitions():
    """At parse time, before any job, as check_prepared_data: every partition the config uses
    that exists must have the assignment.npy whose sha256 its meta.json records, else one
    error names each such file and how to draw it again (partition.corrupt_partition). A
    truncated assignment would otherwise pass a dry run and fail every training job on it.
    Partitions whose meta.json records no sha256 (written before it was recorded) are
    accepted: none is drawn again, no run retrained."""
    problems = [p for rc in PARTITIONS.values() for p in corrupt_partition(rc.partition_dir)]
    if problems:
        raise WorkflowError("fedforget: partitions do not match their checksums:\n  " + "\n  ".join(problems))


check_partitions()


class JobArgument:
    """A value for a job's command line that is not itself a rerun trigger. Snakemake's
    params trigger compares the params of plain types (str, int, float, list, dict, ...)
    and skips any other value (snakemake.persistence, UNREPRESENTABLE); the job's identity
    is then a separate plain param (train_identity), so runtime settings such as threads,
    device or checkpoint frequency reach the job without rerunning it when they change."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def recorded_params(path):
    """The params (their reprs) that Snakemake recorded when it last ran the job of output
    ``path`` (its metadata, which its params trigger compares); [] if none."""
    try:
        from snakemake.io import IOFile

        return [str(p) for p in workflow.persistence.params(IOFile(path)) or []]
    except Exception:  # no metadata to read (at parse time, another Snakemake): none kept
        return []


def kept_code(output, *roots):
    """The digest of the code ``roots`` and what they import (provenance.module_code, from
    the parse where it was computed there) as a params value of the job of ``output``, so
    that a change of that code's behaviour reruns the job: the canonical digest, but a job
    that Snakemake last ran under the ``bytes``-form digest of the same, still
    byte-identical files keeps that digest (the migration: the provenance module's
    docstring), so that upgrading prepares, partitions and draws nothing again."""
    canonical, legacy = DIGESTS["code"].get(roots), DIGESTS["code_bytes"].get(roots)
    if canonical is None or legacy is None:
        canonical, legacy = module_code(*roots).digest, module_code(*roots, form=BYTES).digest
    if os.path.exists(output) and any(legacy in p for p in recorded_params(output)):
        return legacy
    return canonical


def prepare_code(name, output):
    """Digest of the code that prepares dataset ``name`` (its source module and the
    prepared-format writer), as a params value of the job of ``output`` (kept_code), so
    editing that code prepares it again."""
    return kept_code(output, DATASETS.get(name).build.__module__, "fedforget.data.base")


def prepare_params(w):
    name, opts = PREPARE[w.dataset]
    code = prepare_code(name, f"{DATA}/{w.dataset}/meta.json")  # an output of rule prepare_dataset
    return {"name": name, "options": canonical_json(opts), "code": code}


def holdout_input(w):
    return dataset_files(HOLDOUTS[w.public][0])


def holdout_params(w):
    """The private dataset, the slice's spec and the digest of the code that builds both."""
    private, spec = HOLDOUTS[w.public]
    code = prepare_code(PREPARE[private][0], f"{DATA}/public/{w.public}/meta.json")  # rule prepare_public's
    return {"of": private, "spec": canonical_json(spec), "code": code}


def partition_inputs(w):
    return data_inputs(PARTITIONS[(w.pool, w.partition)].dataset)


def partition_params(w):
    rc = PARTITIONS[(w.pool, w.partition)]
    return {
        "name": rc.dataset.name,
        "options": canonical_json(rc.dataset.options),
        "public": canonical_json(rc.dataset.public),
        "spec": canonical_json(rc.partition.to_dict()),
        "code": kept_code(f"{RESULTS}/partitions/{w.pool}/{w.partition}/assignment.npy", "fedforget.partition"),
    }


def train_inputs(w):
    rc = RUNS[run_key(w)]
    return data_inputs(rc.dataset) + [str(rc.partition_dir / "assignment.npy")]


def train_config(w):
    """The job's resolved config, runtime settings included (not a rerun trigger)."""
    return JobArgument(RUN_CONFIGS[RUN_DIRS[run_key(w)]]["config"])


def client_state_mb(w):
    """The MiB of state the job's clients keep once all have trained (resource
    client_state_mb: fedforget.parse.client_state_mb; 0 for most methods)."""
    return RUN_CONFIGS[RUN_DIRS[run_key(w)]]["client_state_mb"]


def recorded_run(rc):
    """The run.json of rc's run directory, or None when there is none or it is not JSON."""
    try:
        return json.loads((Path(rc.run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None


def recorded_identity(rec):
    """run_identity's parts and the status as run.json ``rec`` records them (KeyError or
    TypeError when one is missing)."""
    train = rec["config"]["train"]
    return {"status": rec["status"], "config hash": rec["config_hash"], "code digest": rec["code_digest"],
            "client_engine": train["client_engine"], "engine_pairing": train.get("engine_pairing", "")}  # fmt: skip


def run_identity(rc, rec=None):
    """What a run's results are a function of, beside its input files: the config hash
    (every setting but threads, device, checkpointing and logging: RunConfig.hash), the
    digest of the source it runs (fedforget.provenance) and the client engine it is asked
    for (auto pairs an experiment's methods on one engine: Experiment.engine_pairing).
    The digest is of the source's canonical form, but a finished run recorded before that
    form keeps its recorded digest (of the files' bytes) while those bytes are the same and
    nothing else of its identity changed (provenance.kept_digest): upgrading reruns only the
    runs whose code changed. ``rec``: the run's run.json, read when not given."""
    key = training_key(rc.method.name, rc.method.params)
    identity = {
        "config hash": RUN_CONFIGS[str(rc.run_dir)]["hash"],
        "code digest": DIGESTS["training"][key],
        "client_engine": rc.train.client_engine,
        "engine_pairing": rc.train.engine_pairing,
    }
    legacy = DIGESTS["training_bytes"][key]
    rec = recorded_run(rc) if rec is None else rec
    if kept_digest(rec, legacy):
        try:
            got = recorded_identity(rec)
        except (KeyError, TypeError):
            return identity
        if all(got[k] == v for k, v in identity.items() if k != "code digest"):
            identity["code digest"] = legacy
    return identity


def scheduled_code_digest(path):
    """The code digest in the identity that Snakemake recorded when it last ran the job of
    output ``path``, or None."""
    for p in recorded_params(path):
        m = re.search(r"\bcode ([0-9a-f]{16}) engine ", p)
        if m:
            return m.group(1)
    return None


def train_identity(w):
    """run_identity as the train rule's param: a change to any part reruns exactly this job;
    editing one method's file reruns that method's jobs, editing the engine every job. A run
    recorded before the canonical code digest that ran again for another reason (its config,
    its input files, a forced rerun) while its code stayed byte-identical did so under its
    old digest (run_identity keeps it), which Snakemake recorded, while its new run.json
    holds the canonical one: that job keeps the old digest as long as its files' bytes stay
    the same, so it is not run a second time."""
    rc = RUNS[run_key(w)]
    i = run_identity(rc)
    legacy = DIGESTS["training_bytes"][training_key(rc.method.name, rc.method.params)]
    out = f"{RESULTS}/{w.experiment}/{w.dataset}/{w.partition}/{w.method}/seed{w.seed}/run.json"  # rule train's
    if i["code digest"] != legacy and os.path.exists(out) and scheduled_code_digest(out) == legacy:
        i["code digest"] = legacy
    engine = i["client_engine"] + (" paired" if i["engine_pairing"] else "")
    return f"config {i['config hash']} code {i['code digest']} engine {engine}"


def train_job_threads():
    """The torch threads this invocation's train jobs get (`--threads {threads}`): the rule's
    threads (the profile's set-threads) capped at --cores; None when either is not a number."""
    t, c = (getattr(r, "value", r) for r in (rules.train.rule.resources["_cores"], workflow.global_resources.get("_cores")))
    if not isinstance(t, int):
        return None
    return min(t, c) if isinstance(c, int) else t


def check_adopted_results():
    """`snakemake --touch` marks results that exist as up to date without running anything:
    the step that adopts results pulled from a DVC remote (README, "Sharing data and
    results"), whose files arrive with arbitrary mtimes and no Snakemake metadata. Before
    anything is touched, every run that has a run.json must have completed with this
    checkout's config and code (its config hash, code digest and requested engine, the
    params.identity of rule train) and, if it ran on a CPU, on the torch thread count this
    invocation's train jobs get (provenance.threads_differ); otherwise one error lists each
    such run and nothing is touched. A run without outputs makes --touch itself fail (it
    never creates files)."""
    bad, threads, other_threads = [], train_job_threads(), set()
    for rc in RUNS.values():
        path = Path(rc.run_dir) / "run.json"
        if not path.is_file():
            continue
        try:
            rec = json.loads(path.read_text())
            got = recorded_identity(rec)
        except (ValueError, KeyError, TypeError) as e:
            bad.append(f"{path}: unreadable ({e})")
            continue
        want = {"status": "completed", **run_identity(rc, rec)}
        diff = [f"{k} {got[k]!r} (this checkout: {x!r})" for k, x in want.items() if got[k] != x]
        cpu = threads_differ(rec, threads, rc.train.concurrent_clients)
        if cpu:
            diff.append(cpu)
            other_threads.add(rec["torch_threads"])
        if diff:
            bad.append(f"{path.parent}: {', '.join(diff)}")
    if bad:
        adopt = "".join(f"; CPU results of {n} threads: adopt them with --set-threads train={n} --cores {n}"
                        for n in sorted(other_threads))  # fmt: skip
        listed = "\n  ".join(bad)
        raise WorkflowError(
            f"fedforget: --touch would mark results as up to date that this checkout would not produce:\n  {listed}"
            f"\ncheck out the commit and config they were made with (run.json: git, config){adopt}, or delete "
            "those run directories so that `snakemake` trains them again"
        )


def check_host_memory():
    """Before the first job of a run on one machine (profiles/gpu, or the default profile): a
    warning where the training jobs that may run at once could keep more per-client state
    (resource client_state_mb) with their processes than this machine's memory, and no
    `--resources client_state_mb` caps them (slurm-packed's machine_warning) [D]. Nothing
    under SLURM (slurm-packed plans its submissions itself) or where no job keeps state."""
    res = {k: getattr(v, "value", v) for k, v in workflow.global_resources.items()}
    if not workflow.local_exec or res.get("client_state_mb") is not None or "SLURM_JOB_ID" in os.environ:
        return
    from snakemake_executor_plugin_slurm_packed import machine_warning, state_of

    jobs = [j for j in workflow.dag.needrun_jobs() if j.rule.name == "train"]
    if not any(state_of(j) for j in jobs):
        return
    from fedforget.utils import host_memory_limit  # (imports torch: only where a job keeps state)

    limit = host_memory_limit()
    slots, cores = (res.get(k) if isinstance(res.get(k), int) else None for k in ("gpu_slots", "_cores"))
    warning = limit and machine_warning(jobs, slots, cores, train_job_threads() or 1, limit)
    if warning:
        print(f"fedforget: warning: {warning}", file=sys.stderr)


def experiment_runs(w):
    """Every run's outputs, and the paper results file when the experiment links a paper
    (relative to the working directory, like data/ and results/; checked at parse time)."""
    exp = WF.experiment(w.experiment)
    out = [str(rc.run_dir / "metrics.csv") for rc in exp.runs(DATA, RESULTS)]
    return out + ([WF.paper_results] if exp.paper else [])


def experiment_run_dirs(w):
    exp = WF.experiment(w.experiment)
    return [str(rc.run_dir) for rc in exp.runs(DATA, RESULTS)]


def experiment_paper(w):
    """The paper link and the file it reads ("" when the experiment links none)."""
    exp = WF.experiment(w.experiment)
    return {"link": canonical_json(exp.paper or {}), "results": WF.paper_results if exp.paper else ""}


# digests of the table and figure code (kept_code), a params value of those rules, so that
# editing that code redraws: each a function of the job's wildcards, given an output of its rule
def summary_code(w):
    return kept_code(f"{RESULTS}/{w.experiment}/summary/table.csv", "fedforget.aggregate")


def paper_code(w):
    return kept_code(f"{RESULTS}/{w.experiment}/summary/paper.csv", "fedforget.paper_tables")


def plot_code(figure):
    """The plot code's digest for the rule that draws learning curve ``figure`` (first)."""
    return lambda w: kept_code(f"{RESULTS}/{w.experiment}/figures/{figure}.png", "fedforget.plots")


FIGURES = [c for c in CURVES if c not in CURVE_NEEDS]  # the learning curves rule plot draws for every experiment
# the other curves, each drawn by its rule plot_<curve> for the experiments that measure them
# (fedforget.plots.experiment_curves): no figure of a column a config never measures
MEASURED_CURVES = {exp.name: [c for c in experiment_curves(exp.train_for(m) for m in exp.methods) if c in CURVE_NEEDS]
                   for exp in WF.experiments}  # fmt: skip


def aggregate_outputs():
    """The outputs of rules aggregate and aggregate_continual: one report entry per file, a
    subcategory per experiment, and the label that tells entries apart first (the report
    turns a later label with two values into a toggle)."""
    return dict(
        table=report(
            f"{RESULTS}/{{experiment}}/summary/table.csv",
            caption="../report/table.rst",
            category="Tables",
            subcategory="{experiment}",
            labels={"table": "Summary, mean ± std over seeds (CSV)", "experiment": "{experiment}"},
        ),
        html=report(
            f"{RESULTS}/{{experiment}}/summary/table.html",
            caption="../report/table.rst",
            category="Tables",
            subcategory="{experiment}",
            labels={"table": "Summary, mean ± std over seeds", "experiment": "{experiment}"},
        ),
        markdown=f"{RESULTS}/{{experiment}}/summary/table.md",
        runs=f"{RESULTS}/{{experiment}}/summary/runs.csv",
        metrics=f"{RESULTS}/{{experiment}}/summary/metrics.parquet",
    )


def curve_output(fig, name):
    """A learning curve's figure (``fig``: a curve of CURVES), its report entry labelled
    ``name``."""
    return report(
        f"{RESULTS}/{{experiment}}/figures/{fig}.png",
        caption="../report/curves.rst",
        category="Learning curves",
        subcategory="{experiment}",
        labels={"figure": name, "experiment": "{experiment}"},
    )


def plot_outputs():
    """The outputs of rules plot and plot_continual: one named output and report entry per
    learning curve (FIGURES), each with its own labels (entries with the same labels
    collapse into one in the report)."""
    return {fig: curve_output(fig, CURVES[fig]) for fig in FIGURES}


# labels of experiment-specific figures: the {figure} wildcard takes only these, so rule
# figure never claims the learning curves that rule plot writes beside them
FIGURE_LABELS = sorted({f.label for exp in WF.experiments for f in exp.figures})
FIGURE_LABEL_RE = "|".join(re.escape(x) for x in FIGURE_LABELS) or "(?!)"


def experiment_figure(w):
    """The experiment-specific figure with this label (config: experiments[].figures)."""
    for f in WF.experiment(w.experiment).figures:
        if f.label == w.figure:
            out = f"{RESULTS}/{w.experiment}/figures/{w.figure}.png"  # rule figure's output
            code = kept_code(out, "fedforget.figures", DIGESTS["figures"][f.name])
            return {"name": f.name, "options": canonical_json(f.options), "code": code}
    raise WorkflowError(f"experiment '{w.experiment}' has no figure labelled '{w.figure}'")


# experiments with continual runs (a scenario of more than one task): rules
# aggregate_continual and plot_continual write their continual tables and figures besides;
# the other experiments' rules aggregate and plot write exactly what they wrote before
CONTINUAL = sorted({rc.experiment for rc in RUNS.values() if scenario_shape(rc.dataset.scenario, rc.train.rounds)})


def names_re(names):
    """A wildcard constraint that matches exactly these names (none: nothing)."""
    return "|".join(re.escape(x) for x in names) or "(?!)"


CONTINUAL_RE = names_re(CONTINUAL)
ONE_TASK_RE = names_re(sorted({exp.name for exp in WF.experiments} - set(CONTINUAL)))
# experiments that link a paper table (config key paper): rule paper_table sets the paper's
# numbers beside theirs in the paper's layout (fedforget.paper_tables.PAPER_OUTPUTS)
PAPER_RE = names_re(sorted(exp.name for exp in WF.experiments if exp.paper))


RUN_OUTPUTS = ("metrics.csv", "run.json", "model.pt", "timings.csv", "tasks.csv", "accuracy_matrix.csv")  # rule train's outputs
SUMMARY_OUTPUTS = ("table.csv", "table.md", "table.html", "runs.csv", "metrics.parquet")  # rule aggregate's


def summary_outputs(experiment):
    """The summary files of rule aggregate, or of aggregate_continual for a continual experiment."""
    return SUMMARY_OUTPUTS + (CONTINUAL_OUTPUTS if experiment in CONTINUAL else ())


def stale_summary(w):
    """The experiment's summary files, which a training job removes when it starts: a table
    never claims a run that is being redone (or whose redo failed and left no outputs)."""
    return [f"{RESULTS}/{w.experiment}/summary/{f}" for f in summary_outputs(w.experiment)]


def run_targets(run_dir):
    """A run's outputs, the targets of the default: its run.json, and where that exists each other
    output that is missing. Snakemake does not rebuild a missing intermediate file whose
    consumers are up to date, but it does rebuild a missing target, so a deleted or failed
    run is redone; a job that runs writes all its outputs, and outputs that exist need no
    naming, so the DAG resolves one target per run instead of six (all paper configs' dry
    run: about 1 s less of 11)."""
    if not os.path.exists(f"{run_dir}/run.json"):
        return [f"{run_dir}/run.json"]
    return [f"{run_dir}/{f}" for f in RUN_OUTPUTS if f == "run.json" or not os.path.exists(f"{run_dir}/{f}")]


def all_targets():
    """Every run's targets (run_targets), every experiment's tables and figures, and every
    partition's heatmap; with ``only`` (fedforget.pipeline.parse_only) the selected runs'
    targets and partitions, and the selected experiment's tables and figures where the
    selection is the whole experiment."""
    if ONLY is not None:
        keys = [k for k, rc in RUNS.items() if ONLY.takes(rc)]
        out = [f for k in keys for f in run_targets(RUN_DIRS[k])]
        out += [f"{RESULTS}/partitions/{RUNS[k].dataset.pool_id}/{RUNS[k].partition.slug}/heatmap.png" for k in keys]
        return list(dict.fromkeys(out)) + (experiment_targets(WF.experiment(ONLY.experiment)) if ONLY.whole_experiment else [])
    out = [f for d in RUN_DIRS.values() for f in run_targets(d)]
    out += [f for did in PREPARE for f in dataset_files(did)]
    out += [f for pid in HOLDOUTS for f in public_files(pid)]
    for exp in WF.experiments:
        out += experiment_targets(exp)
    out += [f"{RESULTS}/partitions/{pool}/{slug}/heatmap.png" for pool, slug in PARTITIONS]
    return out


def experiment_targets(exp):
    """An experiment's tables and figures."""
    base = f"{RESULTS}/{exp.name}"
    out = [f"{base}/summary/table.csv", f"{base}/summary/table.md"]
    out += [f"{base}/figures/{f}.png" for f in FIGURES + MEASURED_CURVES[exp.name]]
    if exp.name in CONTINUAL:
        out += [f"{base}/summary/continual.csv", f"{base}/summary/continual.md"]
        out += [f"{base}/figures/{CONTINUAL_DIR}/{f}.png" for f in CONTINUAL_FIGURES]
    out += [f"{base}/figures/{f.label}.png" for f in exp.figures]
    if exp.paper:
        out += [f"{base}/summary/paper.csv", f"{base}/summary/paper.md"]
    return out
