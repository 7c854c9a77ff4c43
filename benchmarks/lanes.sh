#!/usr/bin/env bash
# train.concurrent_clients on a CPU: the sequential trainer with one client after another
# against 2 lanes (clients at once, 1 thread each) on 2 threads, modes interleaved round by
# round in one process (benchmarks/simulation.py, mode `concurrent`), Dirichlet 0.5, 1 local
# epoch: FedAvg on digits, MNIST-1D, ResNet-8 and the McMahan CNN (with the CPU limit where
# it is a reference), iCaRL (not stackable) on split digits, task 1 timed, and FedGP on the
# batched engine with its round-end replies on the lanes (mode vectorized-lanes), then the
# task ends of FedProTIP (batched), GPM and iCaRL with their replies on 2 lanes. About 17
# minutes on 2 cores. The GPU side is gpu.sh's section `lanes`.
# usage: bash benchmarks/lanes.sh [OUTDIR]    (results: OUTDIR/lanes-*.json)
set -eu
out=${1:-cpu-results}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
sim() { python "$here/simulation.py" --interleave --threads 2 --partition dirichlet0.5 --epochs 1 --repeats 1 "$@" | grep -v "^  "; }
sim --preset digits --rounds 10 --modes sequential concurrent limit --json "$out/lanes-digits-dirichlet0.5-e1.json"
sim --preset digits --rounds 10 --eval local --modes sequential concurrent \
    --json "$out/lanes-digits-dirichlet0.5-e1-evallocal.json"
sim --preset mnist1d --rounds 10 --modes sequential concurrent limit --json "$out/lanes-mnist1d-dirichlet0.5-e1.json"
sim --preset digits --rounds 10 --warmup 12 --tasks 2 --method icarl --modes sequential concurrent \
    --json "$out/lanes-digits-icarl.json"
sim --preset digits --rounds 10 --method fedgp --modes vectorized vectorized-lanes \
    --json "$out/lanes-digits-fedgp-batched.json"
sim --preset resnet8 --rounds 5 --modes sequential concurrent --json "$out/lanes-resnet8-dirichlet0.5-e1.json"
sim --preset mcmahan --rounds 8 --modes sequential concurrent limit --json "$out/lanes-mcmahan-dirichlet0.5-e1.json"
# the task end (every client holding the task replies; continual_cost.py's FedProTIP setting)
python "$here/continual_cost.py" --methods fedavg,fedprotip@vectorized,fedprotip@vectorized~2,icarl,icarl~2,gpm,gpm~2 \
    --rounds 2 --json "$out/lanes-continual_cost.json" | tail -8
