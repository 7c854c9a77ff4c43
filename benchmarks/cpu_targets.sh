#!/usr/bin/env bash
# The CPU targets in one go (2 threads, as on CI's 2-core machine): every preset of
# benchmarks/simulation.py under IID and Dirichlet 0.5 clients (digits-k100: IID only, its
# 1347 samples admit no Dirichlet 0.5 split with 10 per client), at 5 and 1 local epochs and
# at 1 epoch with global evaluation every round, modes interleaved round by round in one
# process (robust to this machine's drifting speed), median and min-max of 10 rounds, then
# the memory of 1000 clients with the McMahan CNN. Prints each mode's ratio to the 2-thread
# centralized loop, to the CPU limit (independent single-thread loops, one per worker) and to
# the limit on the clients' own minibatches (limit-clients: whole clients on those loops);
# targets: batched >= 0.95x the limit at 1 and 5 epochs under Dirichlet 0.5. The McMahan
# preset alone takes about an hour; PRESETS="digits mnist1d" runs a subset.
# usage: [PRESETS="..."] bash benchmarks/cpu_targets.sh [OUTDIR]    (results: OUTDIR/*.json)
set -u
out=${1:-cpu-results}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
sim() { python "$here/simulation.py" --interleave --rounds 10 --repeats 1 \
    --modes central limit limit-clients sequential vectorized "$@" | grep -v "^  "; }
for p in ${PRESETS:-mcmahan digits mnist1d digits-k100 mnist1d-k100}; do
    for part in iid dirichlet0.5; do
        [ "$p" = digits-k100 ] && [ "$part" != iid ] && continue
        sim --preset "$p" --partition "$part" --epochs 5 --json "$out/$p-$part-e5.json"
        sim --preset "$p" --partition "$part" --epochs 1 --json "$out/$p-$part-e1.json"
        sim --preset "$p" --partition "$part" --epochs 1 --eval global --json "$out/$p-$part-e1-eval.json"
    done
done
[ -n "${PRESETS:-}" ] && exit 0
python "$here/simulation.py" --memory 1000 --epochs 1 --rounds 1 --repeats 1 --modes sequential vectorized \
    --json "$out/memory-1000.json" | grep -v "^  "
