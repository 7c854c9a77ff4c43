# One federated training job per (experiment, dataset, partition, method, seed).
# An interrupted job leaves checkpoint.pt (not an output, so Snakemake keeps it when it
# cleans the incomplete outputs); `snakemake --rerun-incomplete` resumes from it.
# Threads, GPUs, runtime and partition come from the profile (set-resources/set-threads).
# client_state_mb, the host memory of what a method keeps per client (model copies; buffers,
# exemplars, bases, class reports at their fullest), comes from the config: jobs sharing one
# SLURM submission (slurm-packed) run at once only as many as fit its mem_mb, each with its
# process (slurm-packed-process-mb); on one machine `--resources client_state_mb=N` caps them
# (unset, a run that could exceed the machine's memory warns first: common.smk, check_host_memory).
# Rerun triggers: params.identity (config hash + code digest), the input files' mtimes;
# params.cfg carries runtime settings too but is not a trigger (common.smk, JobArgument).


rule train:
    input:
        train_inputs,
    output:
        metrics=f"{RESULTS}/{{experiment}}/{{dataset}}/{{partition}}/{{method}}/seed{{seed}}/metrics.csv",
        run=f"{RESULTS}/{{experiment}}/{{dataset}}/{{partition}}/{{method}}/seed{{seed}}/run.json",
        model=f"{RESULTS}/{{experiment}}/{{dataset}}/{{partition}}/{{method}}/seed{{seed}}/model.pt",
        timings=f"{RESULTS}/{{experiment}}/{{dataset}}/{{partition}}/{{method}}/seed{{seed}}/timings.csv",
        tasks=f"{RESULTS}/{{experiment}}/{{dataset}}/{{partition}}/{{method}}/seed{{seed}}/tasks.csv",
        matrix=f"{RESULTS}/{{experiment}}/{{dataset}}/{{partition}}/{{method}}/seed{{seed}}/accuracy_matrix.csv",
    params:
        cfg=train_config,
        identity=train_identity,
        out=subpath(output.run, parent=True),
        stale=stale_summary,
    threads: 1
    resources:
        gpu=0,
        client_state_mb=client_state_mb,
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/train/{experiment}/{dataset}/{partition}/{method}/seed{seed}.log",
    shell:
        "rm -f {params.stale:q} && "
        "fedforget train --config-json {params.cfg:q} --out {params.out:q} --threads {threads} > {log:q} 2>&1"
