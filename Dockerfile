# The pipeline's software in a container (the image a cluster without conda can run the rules
# in: `snakemake --sdm apptainer` with `--default-container`, or `docker run` of one rule's
# `fedforget ...` command): Python 3.11 and this repository's package with its console
# script, installed from the checkout as `make install` does. Build from the repository root:
#   docker build -t fedforget .
# Not built in this project's CI (no container runtime there).
FROM python:3.11-slim
WORKDIR /opt/fedforget
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && fedforget --version
WORKDIR /work
