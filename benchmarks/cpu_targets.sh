#!/usr/bin/env bash
# Issue 7's CPU targets in one go (2 threads, as on CI's 2-core machine): every preset of
# benchmarks/simulation.py at 5 and 1 local epochs and at 1 epoch with global evaluation
# every round, modes interleaved round by round in one process (robust to this machine's
# drifting speed), then the memory of 1000 clients with the McMahan CNN. Prints the
# ratios to the centralized loop; targets: >= 1.0 (5 epochs), >= 0.95 (1 epoch), >= 0.9
# (with evaluation). About 25 minutes on 2 cores.
# usage: bash benchmarks/cpu_targets.sh [OUTDIR]    (results: OUTDIR/*.json)
set -u
out=${1:-cpu-results}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
sim() { python "$here/simulation.py" --interleave "$@" | grep -v "^  "; }
for p in mcmahan digits mnist1d digits-k100 mnist1d-k100; do
    r=10
    [ "$p" = mcmahan ] && r=3
    sim --preset "$p" --epochs 5 --rounds $((r > 3 ? r / 2 : 2)) --repeats 2 --json "$out/$p-e5.json"
    sim --preset "$p" --epochs 1 --rounds "$r" --repeats 2 --json "$out/$p-e1.json"
    sim --preset "$p" --epochs 1 --eval global --rounds "$r" --repeats 2 --json "$out/$p-e1-eval.json"
done
python "$here/simulation.py" --memory 1000 --epochs 1 --rounds 1 --repeats 1 --modes sequential vectorized \
    --json "$out/memory-1000.json" | grep -v "^  "
