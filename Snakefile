# Entry point: the workflow lives in workflow/. Snakemake drops a default target set inside
# an included file (snakemake/snakemake#2056, #2773), so the default is named here.
include: "workflow/Snakefile"


rule default:
    default_target: True
    input:
        rules.all.input,
