#!/usr/bin/env bash
# One `make smoke` pass of every config (paper configs, then the embedded ones), config by
# config, resumable: a config already in the log is skipped, so a pass longer than one
# sitting (about 5 h on 2 cores) continues at the same commit in a later one. Run it in a
# clone or worktree of the commit to certify, .venv/bin on PATH (its log lines record that commit):
#   git worktree add /tmp/pass <commit> && cd /tmp/pass && bash benchmarks/smoke_pass.sh LOG.jsonl
# Each config runs as tests/test_smoke.py runs it under `make smoke` (FEDFORGET_SMOKE_ALL=1),
# in its own temporary directory, removed after it.
set -u
log=$(realpath -m "${1:?usage: smoke_pass.sh LOG.jsonl}")
repo=$(cd "$(dirname "$0")/.." && pwd)
cores=${SMOKE_CORES:-$(nproc 2>/dev/null || echo 2)}
tmp=$(mktemp -d /tmp/fedforget-smoke-pass.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$(dirname "$log")"
cd "$repo"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" FEDFORGET_SMOKE_ALL=1 FEDFORGET_SMOKE_CORES=$cores FEDFORGET_SMOKE_LOG=$log
for kind in paper embedded; do
  if [ $kind = paper ]; then dir=config/experiments/paper; test=every_paper_config; else dir=config/experiments; test=every_embedded_config; fi
  for f in "$dir"/*.yaml; do
    name=$(basename "$f")
    grep -q "\"config\": \"$name" "$log" 2>/dev/null && continue
    echo "$(date +%T) $name" >&2
    python -m pytest tests/test_smoke.py -k "$test and $name" -p no:cacheprovider -q --basetemp="$tmp/run" > "$tmp/out.txt" 2>&1 || tail -20 "$tmp/out.txt" >&2
    rm -rf "$tmp/run"
  done
done
