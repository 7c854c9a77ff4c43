# Helpers: the config is validated once here, at parse time (schema + registries + sizes),
# before any job starts, and expanded into lookup tables that the rules read by wildcard.
import json
import re
from pathlib import Path

from snakemake.exceptions import WorkflowError

from fedforget.config import parse_config
from fedforget.utils import FedForgetError, canonical_json

try:
    WF = parse_config(config)
except FedForgetError as err:
    raise WorkflowError(f"fedforget: {err}") from None

DATA = WF.data_dir
RESULTS = WF.results_dir

RUNS = {
    (rc.experiment, rc.dataset.label, rc.partition.slug, rc.method.label, str(rc.seed)): rc
    for rc in WF.runs()
}
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


def dataset_meta(did):
    return f"{DATA}/{did}/meta.json"


def public_meta(pid):
    return f"{DATA}/public/{pid}/meta.json"


def data_inputs(ds):
    """Prepared files a job reads for a dataset spec: the dataset and its public set."""
    out = [dataset_meta(ds.id)]
    if ds.public:
        out.append(public_meta(ds.public_id) if ds.public["source"] == "holdout" else dataset_meta(ds.public_id))
    return out


def prepare_params(w):
    name, opts = PREPARE[w.dataset]
    return {"name": name, "options": canonical_json(opts)}


def holdout_input(w):
    return dataset_meta(HOLDOUTS[w.public][0])


def holdout_params(w):
    private, spec = HOLDOUTS[w.public]
    return {"of": private, "spec": canonical_json(spec)}


def partition_inputs(w):
    return data_inputs(PARTITIONS[(w.pool, w.partition)].dataset)


def partition_params(w):
    rc = PARTITIONS[(w.pool, w.partition)]
    return {
        "name": rc.dataset.name,
        "options": canonical_json(rc.dataset.options),
        "public": canonical_json(rc.dataset.public),
        "spec": canonical_json(rc.partition.to_dict()),
    }


def train_inputs(w):
    rc = RUNS[run_key(w)]
    return data_inputs(rc.dataset) + [str(rc.partition_dir / "assignment.npy")]


def train_config(w):
    """The job's resolved config: a params value, so a change to it reruns only this job."""
    return canonical_json(RUNS[run_key(w)].to_dict())


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


FIGURES = ["global_model_test_acc", "local_models_global_test_acc_mean", "sampled_clients_local_train_loss_mean"]


# labels of experiment-specific figures: the {figure} wildcard takes only these, so rule
# figure never claims the learning curves that rule plot writes beside them
FIGURE_LABELS = sorted({f.label for exp in WF.experiments for f in exp.figures})
FIGURE_LABEL_RE = "|".join(re.escape(x) for x in FIGURE_LABELS) or "(?!)"


def experiment_figure(w):
    """The experiment-specific figure with this label (config: experiments[].figures)."""
    for f in WF.experiment(w.experiment).figures:
        if f.label == w.figure:
            return {"name": f.name, "options": canonical_json(f.options)}
    raise WorkflowError(f"experiment '{w.experiment}' has no figure labelled '{w.figure}'")


def all_targets():
    out = []
    for exp in WF.experiments:
        base = f"{RESULTS}/{exp.name}"
        out += [f"{base}/summary/table.csv", f"{base}/summary/table.md"]
        out += [f"{base}/figures/{f}.png" for f in FIGURES]
        out += [f"{base}/figures/{f.label}.png" for f in exp.figures]
    out += [f"{RESULTS}/partitions/{pool}/{slug}/heatmap.png" for pool, slug in PARTITIONS]
    return out
