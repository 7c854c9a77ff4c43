#!/usr/bin/env bash
# Wall time of the default pipeline (config/config.yaml: prepare -> partition -> 18 training
# jobs -> aggregate -> plot -> report) from scratch, in a temporary directory, with the local
# profile (2 cores). Prints the total and per-job wall times read from each run.json.
# Usage: PATH=.venv/bin:$PATH bash benchmarks/default_pipeline.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$repo/config" "$work/config"
cd "$work"
start=$(date +%s.%N)
snakemake -s "$repo/Snakefile" --quiet all > snakemake.log 2>&1
snakemake -s "$repo/Snakefile" --report report.html > report.log 2>&1
end=$(date +%s.%N)
python - "$start" "$end" <<'PY'
import glob, json, statistics, sys
start, end = map(float, sys.argv[1:3])
walls = [json.load(open(f))["wall_time_s"] for f in glob.glob("results/*/*/*/*/seed*/run.json")]
print(f"default pipeline, from scratch, incl. report: {end - start:.1f} s wall")
print(f"training jobs: {len(walls)}; per job (in-process) wall: median {statistics.median(walls):.1f} s, max {max(walls):.1f} s")
print(open(glob.glob('results/*/summary/table.md')[0]).read())
PY
