# One partition per (private pool, partition spec); the path is keyed by the full spec.


rule partition:
    input:
        partition_inputs,
    output:
        assignment=f"{RESULTS}/partitions/{{pool}}/{{partition}}/assignment.npy",
        meta=f"{RESULTS}/partitions/{{pool}}/{{partition}}/meta.json",
        counts=f"{RESULTS}/partitions/{{pool}}/{{partition}}/class_counts.csv",
        heatmap=report(
            f"{RESULTS}/partitions/{{pool}}/{{partition}}/heatmap.png",
            caption="../report/heatmap.rst",
            category="Partitions",
            subcategory="{pool}",
            labels={"partition": "{partition}", "pool": "{pool}"},
        ),
    params:
        p=partition_params,
        root=DATA,
        out=f"{RESULTS}/partitions/{{pool}}/{{partition}}",
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/partition/{pool}/{partition}.log",
    shell:
        "fedforget partition --dataset {params.p[name]:q} --options {params.p[options]:q} "
        "--public {params.p[public]:q} --spec {params.p[spec]:q} --root {params.root:q} "
        "--out {params.out:q} > {log:q} 2>&1"


localrules:
    partition,
