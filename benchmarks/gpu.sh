#!/usr/bin/env bash
# The GPU checks and measurements in one go, for a machine with a CUDA GPU and a Python whose
# torch sees it (fedforget importable: installed, or PYTHONPATH=src).
#   1. the engine and device tests on the GPU (FEDFORGET_TEST_DEVICE=cuda, TF32 off): clients
#      trained together give the same metrics as one after another within 1e-5, CUDA graphs
#      the same bits as eager steps, `device: auto` takes the GPU and records it;
#   2. benchmarks/profile_round.py on the McMahan preset (Dirichlet 0.5, 1 epoch), with and
#      without CUDA graphs (FEDFORGET_CUDA_GRAPHS=0): s/round, how busy the GPU was, kernel
#      launches per round;
#   3. benchmarks/simulation.py, McMahan CNN preset (100 clients, 10% per round, batch 50):
#      Dirichlet 0.5 and IID at 1 local epoch, Dirichlet 0.5 at 5, 1 epoch with global
#      evaluation every round; the last line of each says vectorized / sequential. Rounds are
#      timed after WARMUP rounds, by which time the step shapes a run meets have their graphs;
#   4. the embedded models with 100 clients (digits-k100 IID: its 1347 samples admit no Dirichlet 0.5
#      split with 10 per client; mnist1d-k100 Dirichlet 0.5);
#   5. FedProx, FedDyn and SCAFFOLD on the McMahan preset, 1 epoch (their per-step terms run
#      eagerly: no graphs); ResNet-18 FedAvg against a plain loop, FedGP over FedAvg on
#      ResNet-18 and the McMahan preset and FedProTIP(-t) on ResNet-18 (task 1 of a split),
#      sequential vs stacked.
#      The McMahan preset once more with train.precision bf16 (autocast);
#      FedSOL's round profiled (sequential: GPU busy share);
#   6. benchmarks/packing.py: 1, 2 and 4 training jobs sharing the GPU (gpu_slots), McMahan
#      CNN and ResNet-18, with each job's peak GPU memory.
# usage: bash benchmarks/gpu.sh [OUTDIR]    (results: OUTDIR/*.json, OUTDIR/*.txt); all of it
#        has not yet run within the 8-minute budget of one device session: split it with SECTIONS
#        SECTIONS="tests resnet18" bash benchmarks/gpu.sh OUTDIR   (a part, to fit a device budget:
#        tests profile sims methods resnet18 fedsol packing; default all)
set -u
want() { [ "${SECTIONS:-all}" = all ] || case " $SECTIONS " in *" $1 "*) true ;; *) false ;; esac; }
out=${1:-gpu-results}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/gpu.txt"
want tests && FEDFORGET_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider "$here/../tests/test_device.py" \
    "$here/../tests/test_vectorized.py" "$here/../tests/test_dropout.py" "$here/../tests/methods/test_batched_uploads.py" 2>&1 | tail -40 | tee "$out/tests.txt"
want profile && for g in 1 0; do
    FEDFORGET_CUDA_GRAPHS=$g python "$here/profile_round.py" --preset mcmahan --mode vectorized --device cuda \
        --warmup 15 --rounds 5 --rows 15 >"$out/profile-graphs$g.txt" 2>&1
    sed -n 1,3p "$out/profile-graphs$g.txt"
done
WARMUP=${WARMUP:-15}
sim() { python "$here/simulation.py" --device cuda --warmup "$WARMUP" --repeats 1 --modes sequential vectorized "$@"; }
if want sims; then
sim --preset mcmahan --partition dirichlet0.5 --epochs 1 --rounds 20 --json "$out/mcmahan-dir-e1.json" | tee -a "$out/sim.txt"
sim --preset mcmahan --partition iid --epochs 1 --rounds 20 --json "$out/mcmahan-iid-e1.json" | tee -a "$out/sim.txt"
sim --preset mcmahan --partition dirichlet0.5 --epochs 5 --rounds 10 --json "$out/mcmahan-dir-e5.json" | tee -a "$out/sim.txt"
sim --preset mcmahan --partition dirichlet0.5 --epochs 1 --rounds 10 --eval global --json "$out/mcmahan-dir-e1-eval.json" | tee -a "$out/sim.txt"
for p in digits-k100 mnist1d-k100; do
    sim --preset "$p" --partition "$([ "$p" = digits-k100 ] && echo iid || echo dirichlet0.5)" --epochs 1 --rounds 10 --json "$out/$p-e1.json" | tee -a "$out/sim.txt"
done
sim --preset mcmahan --partition dirichlet0.5 --epochs 1 --rounds 10 --precision bf16 --json "$out/mcmahan-dir-e1-bf16.json" | tee -a "$out/sim.txt"
fi
if want methods; then
for m in fedprox feddyn scaffold; do
    sim --preset mcmahan --partition dirichlet0.5 --epochs 1 --rounds 5 --method "$m" --json "$out/mcmahan-e1-$m.json" | tee -a "$out/sim.txt"
done
fi
if want resnet18; then
# ResNet-18 (BatchNorm, issue 32's setting): FedAvg against a plain loop (central), and FedGP
# over FedAvg (its projection a gradient map of the stacked step), sequential vs stacked
python "$here/simulation.py" --device cuda --warmup 3 --repeats 1 --modes central sequential vectorized \
    --preset resnet18 --partition dirichlet0.5 --epochs 1 --rounds 5 --json "$out/resnet18-dir-e1.json" | tee -a "$out/sim.txt"
sim --preset resnet18 --partition dirichlet0.5 --epochs 1 --rounds 5 --method fedgp --json "$out/resnet18-e1-fedgp.json" | tee -a "$out/sim.txt"
sim --preset mcmahan --partition dirichlet0.5 --epochs 1 --rounds 5 --method fedgp --json "$out/mcmahan-e1-fedgp.json" | tee -a "$out/sim.txt"
# FedProTIP(-t) on ResNet-18, split 5 x 2: task 0 and its bases in the warm-up, task 1's
# projected rounds timed, sequential vs stacked
python "$here/simulation.py" --device cuda --warmup 4 --repeats 1 --modes sequential vectorized --preset resnet18 \
    --partition dirichlet0.5 --epochs 1 --rounds 3 --method fedprotip --params '{"tip": "none"}' --tasks 5 \
    --json "$out/resnet18-e1-fedprotip.json" | tee -a "$out/sim.txt"
# A-GEM and DER on ResNet-18, split 5 x 2 (FedGP's baselines): each client's memory batches in
# one stacked forward, BatchNorm statistics per client; task 0 in the warm-up (buffers fill)
for m in agem der; do
python "$here/simulation.py" --device cuda --warmup 4 --repeats 1 --modes sequential vectorized --preset resnet18 \
    --partition dirichlet0.5 --epochs 1 --rounds 3 --method "$m" --tasks 5 \
    --json "$out/resnet18-e1-$m.json" | tee -a "$out/sim.txt"
done
fi
if want fedsol; then
# FedSOL (sequential: two passes per step), how busy it keeps the GPU now that its step reads
# nothing back to the host (23 % before)
python "$here/profile_round.py" --preset mcmahan --mode sequential --method fedsol --device cuda \
    --warmup 3 --rounds 3 --rows 15 >"$out/profile-fedsol.txt" 2>&1
sed -n 1,3p "$out/profile-fedsol.txt"
fi
if want packing; then
# 6. several training jobs sharing the GPU (profiles/gpu, gpu_slots): 1, 2, 4 at once, McMahan
#    CNN and ResNet-18 (CIFAR-shaped, BatchNorm), batched engine; peak GPU memory per job
for p in mcmahan resnet18; do
    python "$here/packing.py" --preset "$p" --device cuda --threads 2 --warmup 5 --seconds 10 \
        --json "$out/packing-$p.json" | tee -a "$out/packing.txt"
done
fi
