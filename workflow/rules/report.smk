# Tables (mean ± std over seeds, beside the papers' numbers) and figures per experiment.


rule aggregate:
    input:
        experiment_runs,
    output:
        **aggregate_outputs(),
    wildcard_constraints:
        experiment=ONE_TASK_RE,
    params:
        runs=experiment_run_dirs,
        paper=experiment_paper,
        code=summary_code,
        out=subpath(output.table, parent=True),
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/aggregate/{experiment}.log",
    shell:
        "fedforget aggregate --runs {params.runs:q} --out {params.out:q} --experiment {wildcards.experiment:q} "
        "--paper {params.paper[link]:q} --paper-results={params.paper[results]:q} > {log:q} 2>&1"


# the same command for experiments with continual runs, which also writes the continual
# summary (fedforget.continual.CONTINUAL_OUTPUTS) and its tables for the report
use rule aggregate as aggregate_continual with:
    output:
        **aggregate_outputs(),
        continual=report(
            f"{RESULTS}/{{experiment}}/summary/continual.csv",
            caption="../report/continual_table.rst",
            category="Tables",
            subcategory="{experiment}",
            labels={"table": "Continual metrics, mean ± std over seeds (CSV)", "experiment": "{experiment}"},
        ),
        continual_html=report(
            f"{RESULTS}/{{experiment}}/summary/continual.html",
            caption="../report/continual_table.rst",
            category="Tables",
            subcategory="{experiment}",
            labels={"table": "Continual metrics, mean ± std over seeds", "experiment": "{experiment}"},
        ),
        continual_markdown=f"{RESULTS}/{{experiment}}/summary/continual.md",
        tasks=f"{RESULTS}/{{experiment}}/summary/tasks.parquet",
        matrices=f"{RESULTS}/{{experiment}}/summary/accuracy_matrix.csv",
    wildcard_constraints:
        experiment=CONTINUAL_RE,


# the linked paper table(s) beside ours, in the paper's layout (fedforget.paper_tables), for
# the experiments that link one (config key paper)
rule paper_table:
    input:
        runs=f"{RESULTS}/{{experiment}}/summary/runs.csv",
        results=WF.paper_results,
    output:
        table=report(
            f"{RESULTS}/{{experiment}}/summary/paper.csv",
            caption="../report/paper_table.rst",
            category="Tables",
            subcategory="{experiment}",
            labels={"table": "Paper vs ours, in the paper's layout (CSV)", "experiment": "{experiment}"},
        ),
        html=report(
            f"{RESULTS}/{{experiment}}/summary/paper.html",
            caption="../report/paper_table.rst",
            category="Tables",
            subcategory="{experiment}",
            labels={"table": "Paper vs ours, in the paper's layout", "experiment": "{experiment}"},
        ),
        markdown=f"{RESULTS}/{{experiment}}/summary/paper.md",
    wildcard_constraints:
        experiment=PAPER_RE,
    params:
        paper=experiment_paper,
        code=paper_code,
        summary=subpath(input.runs, parent=True),
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/paper_table/{experiment}.log",
    shell:
        "fedforget paper-table --summary {params.summary:q} --experiment {wildcards.experiment:q} "
        "--paper {params.paper[link]:q} --paper-results={params.paper[results]:q} > {log:q} 2>&1"


rule plot:
    input:
        f"{RESULTS}/{{experiment}}/summary/metrics.parquet",
    output:
        **plot_outputs(),
    wildcard_constraints:
        experiment=ONE_TASK_RE,
    params:
        summary=subpath(input[0], parent=True),
        out=f"{RESULTS}/{{experiment}}/figures",
        code=plot_code(FIGURES[0]),
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/plot/{experiment}.log",
    shell:
        "fedforget plot --summary {params.summary:q} --out {params.out:q} > {log:q} 2>&1"


# the same command for experiments with continual runs: the learning curves and the
# continual figures (fedforget.plots.CONTINUAL_FIGURES, in figures/continual/)
use rule plot as plot_continual with:
    input:
        f"{RESULTS}/{{experiment}}/summary/metrics.parquet",
        f"{RESULTS}/{{experiment}}/summary/runs.csv",
        f"{RESULTS}/{{experiment}}/summary/tasks.parquet",
        f"{RESULTS}/{{experiment}}/summary/accuracy_matrix.csv",
    output:
        **plot_outputs(),
        **{
            f"continual_{fig}": report(
                f"{RESULTS}/{{experiment}}/figures/{CONTINUAL_DIR}/{fig}.png",
                caption="../report/continual.rst",
                category="Continual learning",
                subcategory="{experiment}",
                labels={"figure": name, "experiment": "{experiment}"},
            )
            for fig, name in CONTINUAL_FIGURES.items()
        },
    wildcard_constraints:
        experiment=CONTINUAL_RE,


# each learning curve that only some runs measure (fedforget.plots.CURVE_NEEDS), for the
# experiments whose config measures it (MEASURED_CURVES): the others publish no such figure
for curve in CURVE_NEEDS:

    rule:
        name:
            f"plot_{curve}"
        input:
            f"{RESULTS}/{{experiment}}/summary/metrics.parquet",
        output:
            curve=curve_output(curve, CURVES[curve]),
        wildcard_constraints:
            experiment=names_re(sorted(e for e, cs in MEASURED_CURVES.items() if curve in cs)),
        params:
            summary=subpath(input[0], parent=True),
            out=f"{RESULTS}/{{experiment}}/figures",
            code=plot_code(curve),
            curve=curve,
        conda:
            "../envs/fedforget.yaml"
        log:
            f"logs/plot/{{experiment}}.{curve}.log",
        localrule: True
        shell:
            "fedforget plot --summary {params.summary:q} --out {params.out:q} --curves {params.curve:q} "
            "--curves-only > {log:q} 2>&1"


rule figure:
    input:
        runs=f"{RESULTS}/{{experiment}}/summary/runs.csv",
        metrics=f"{RESULTS}/{{experiment}}/summary/metrics.parquet",
    output:
        report(
            f"{RESULTS}/{{experiment}}/figures/{{figure}}.png",
            caption="../report/figure.rst",
            category="Figures",
            subcategory="{experiment}",
            labels={"figure": "{figure}", "experiment": "{experiment}"},
        ),
    wildcard_constraints:
        figure=FIGURE_LABEL_RE,
    params:
        fig=experiment_figure,
        summary=subpath(input.runs, parent=True),
    conda:
        "../envs/fedforget.yaml"
    log:
        "logs/figure/{experiment}/{figure}.log",
    shell:
        "fedforget figure --summary {params.summary:q} --experiment {wildcards.experiment:q} "
        "--name {params.fig[name]:q} --options {params.fig[options]:q} --out {output:q} > {log:q} 2>&1"


localrules:
    aggregate,
    aggregate_continual,
    paper_table,
    plot,
    plot_continual,
    figure,
