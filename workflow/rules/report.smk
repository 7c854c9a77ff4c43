# Tables (mean ± std over seeds, beside the papers' numbers) and figures per experiment.


rule aggregate:
    input:
        experiment_runs,
    output:
        # one report entry per file: a subcategory per experiment, and the label that tells
        # entries apart first (the report turns a later label with two values into a toggle)
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
    params:
        runs=experiment_run_dirs,
        paper=experiment_paper,
        code=AGGREGATE_CODE,
        out=subpath(output.table, parent=True),
    log:
        "logs/aggregate/{experiment}.log",
    shell:
        "fedforget aggregate --runs {params.runs} --out {params.out} --experiment {wildcards.experiment} "
        "--paper {params.paper[link]:q} --paper-results={params.paper[results]:q} > {log} 2>&1"


rule plot:
    input:
        f"{RESULTS}/{{experiment}}/summary/metrics.parquet",
    output:
        # one named output and report entry per learning curve (FIGURES), each with its own
        # labels: entries with the same labels collapse into one in the report
        **{
            fig: report(
                f"{RESULTS}/{{experiment}}/figures/{fig}.png",
                caption="../report/curves.rst",
                category="Learning curves",
                subcategory="{experiment}",
                labels={"figure": CURVES[fig], "experiment": "{experiment}"},
            )
            for fig in FIGURES
        },
    params:
        summary=subpath(input[0], parent=True),
        out=f"{RESULTS}/{{experiment}}/figures",
        code=PLOT_CODE,
    log:
        "logs/plot/{experiment}.log",
    shell:
        "fedforget plot --summary {params.summary} --out {params.out} > {log} 2>&1"


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
    log:
        "logs/figure/{experiment}/{figure}.log",
    shell:
        "fedforget figure --summary {params.summary} --experiment {wildcards.experiment} "
        "--name {params.fig[name]} --options {params.fig[options]:q} --out {output} > {log} 2>&1"


localrules:
    aggregate,
    plot,
    figure,
