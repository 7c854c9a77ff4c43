#!/usr/bin/env bash
# Issue 7's GPU checks and measurements in one go, for a machine with a CUDA GPU and a
# Python whose torch sees it (fedforget importable: installed, or PYTHONPATH=src).
#   1. the engine-equivalence tests on the GPU (FEDFORGET_TEST_DEVICE=cuda, TF32 off):
#      clients trained together give the same metrics as one after another, within 1e-5;
#   2. benchmarks/simulation.py, McMahan CNN preset (100 clients, 10% per round, batch 50)
#      on cuda: 1 and 5 local epochs, and 1 epoch with global evaluation every round; the
#      last line of each says vectorized / sequential (the issue's target: >= 5x);
#   3. the same for the embedded models with 100 clients (digits-k100, mnist1d-k100);
#   4. FedProx, FedDyn and SCAFFOLD on the McMahan preset, 1 epoch: sequential vs vectorized.
# usage: bash benchmarks/gpu.sh [OUTDIR]    (results: OUTDIR/*.json, OUTDIR/*.txt)
set -u
out=${1:-gpu-results}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/gpu.txt"
FEDFORGET_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider \
    "$here/../tests/test_vectorized.py" "$here/../tests/methods/test_batched_uploads.py" 2>&1 | tail -40 | tee "$out/tests.txt"
sim() { python "$here/simulation.py" --device cuda --rounds 10 --repeats 2 "$@"; }
for e in 1 5; do
    sim --preset mcmahan --epochs "$e" --json "$out/mcmahan-e$e.json" | tee -a "$out/sim.txt"
done
sim --preset mcmahan --epochs 1 --eval global --json "$out/mcmahan-e1-eval.json" | tee -a "$out/sim.txt"
for p in digits-k100 mnist1d-k100; do
    sim --preset "$p" --epochs 1 --repeats 1 --json "$out/$p-e1.json" | tee -a "$out/sim.txt"
done
for m in fedprox feddyn scaffold; do
    sim --preset mcmahan --epochs 1 --method "$m" --modes sequential vectorized --repeats 1 \
        --json "$out/mcmahan-e1-$m.json" | tee -a "$out/sim.txt"
done
