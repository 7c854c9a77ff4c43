# Datasets and public sets are written into data/ (tracked by DVC: `dvc add data`).
import shlex

# The paper datasets' native files: config keys raw_dir (default <data_dir>/raw) and download.
# A location and a permission, not content: a JobArgument, so neither is a rerun trigger.
RAW_ARGS = JobArgument(
    f"--raw-dir {shlex.quote(config.get('raw_dir') or f'{DATA}/raw')}" + (" --download" if config.get("download") else "")
)


rule prepare_dataset:
    output:
        multiext(f"{DATA}/{{dataset}}/", "x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy", "meta.json"),
    params:
        p=prepare_params,
        root=subpath(output[-1], ancestor=2),
        raw=RAW_ARGS,
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/prepare/{dataset}.log",
    # a failure's one error (a missing or corrupt native file and how to obtain it) is also
    # printed to Snakemake's output, not only to the log
    shell:
        "fedforget prepare --dataset {params.p[name]:q} --options {params.p[options]:q} --root {params.root:q} {params.raw} "
        "> {log:q} 2>&1 || {{ awk 'e || /^fedforget: error/ {{ e = 1; print }}' {log:q} >&2; exit 1; }}"


# The public slice is a function of its dataset's id (name + options), its spec and the code
# (params); its input is ancient: a dataset file that is only newer (DVC checks files out in
# no fixed order) does not re-cut it.
rule prepare_public:
    input:
        ancient(holdout_input),
    output:
        multiext(f"{DATA}/public/{{public}}/", "x.npy", "y.npy", "indices.npy", "meta.json"),
    params:
        p=holdout_params,
        root=subpath(output[-1], ancestor=3),
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/prepare/public_{public}.log",
    shell:
        "fedforget prepare --public {params.p[spec]:q} --of {params.p[of]:q} --root {params.root:q} > {log:q} 2>&1"


localrules:
    prepare_dataset,
    prepare_public,
