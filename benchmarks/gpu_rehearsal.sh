#!/usr/bin/env bash
# A CPU rehearsal of benchmarks/gpu.sh, started as a device call starts it (gpu_device.sh):
# every command of its sections run to its end on the CPU, on fewer rows, so that a section
# that would fail on the GPU (a crash outside the GPU code paths, an argument, a preset) fails
# here first; a device session is 15 minutes. The numbers it prints are not measurements
# (toy sizes, a CPU): only exit codes and errors count.
#
# What it changes, on a clone of the committed HEAD in a temporary directory (the working
# tree is left alone): a stand-in `python` first on PATH (benchmarks/gpu_rehearsal.py's
# rewrite) gives simulation.py, profile_round.py and packing.py `--train-rows 6000` on a
# blobs preset of the default size (6000 training and 1000 test rows: the ResNet-18
# preset's 100 clients hold 60 rows each; the ViT-B/16 at 224 px 60 rows), turns
# `--device cuda` into cpu, every --rounds into 1, --warmup into at most 2 (packing.py: 1;
# a continual profile: 3), --seconds into 3, --budget into 40, --steps into 2, and a
# simulation's --clients N --rate R into 40 and 0.25, and gives model_rates.py --clients 2
# --eval-rows 64; a stand-in `timeout` lifts each box's
# limit to 1200 s; the GPU tests run on the CPU along a GPU's code paths (every stacked step
# batched, the lr on the device, channels_last stacks, CUDA graphs through the tape, the GPU's
# tolerances: FEDFORGET_TEST_GPU_PATHS=1, tests/conftest.py; their first run, 2026-12-06, found
# a test that read the host inside a captured step; then, with them, every engine and method
# test so; ORDER=tests runs those alone, about 4 minutes on 2 cores). Section hf's batched
# TinyBERT with 10 clients needs more than 24 GB of host memory, hence the 2 clients above (since
# 2026-12-07; before, the rehearsals left hf out). After gpu.sh it runs the step its header names after section rates:
# benchmarks/paper_runtime.py on the run's rate files.
# Its first run, by hand with these changes (2026-12-05, 83 minutes on 2 cores; its text output in
# results/cpu-2026-12-05/gpu-rehearsal/), found the resnet18-imagenet preset's one-row batches;
# its second, as this script after the fixes (65 minutes; gpu-rehearsal-b/, without the ViT
# commands, which ORDER="vit joined" ran after: 10 minutes, gpu-rehearsal-b/vit-joined/), only
# the TinyBERT.
# Its latest whole run (the default order, hf included, on 2 cores, at 8eb3d05: results/cpu-2026-12-07-i/):
# 50 commands, no failure, about 65 minutes (gpu.sh's 63).
#   usage: bash benchmarks/gpu_rehearsal.sh [OUTDIR]    (default: /tmp/gpu-rehearsal)
set -eu
out=$(mkdir -p "${1:-/tmp/gpu-rehearsal}" && cd "${1:-/tmp/gpu-rehearsal}" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
real=$(command -v python)
real_timeout=$(command -v timeout)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/repo"
mkdir -p "$work/bin" "$work/tmp"
cat >"$work/bin/python" <<EOF
#!$real
import sys
sys.path.insert(0, "$work/repo/benchmarks")
import gpu_rehearsal  # what it changes in each command
gpu_rehearsal.stand_in("$real", "$out/calls.txt")
EOF
cat >"$work/bin/timeout" <<EOF
#!/usr/bin/env bash
while [ "\${1#-}" != "\$1" ]; do [ "\$1" = -k ] && shift; shift; done
shift
exec "$real_timeout" -k 5 1200 "\$@"
EOF
printf '#!/bin/sh\necho "stand-in: a CPU rehearsal (benchmarks/gpu_rehearsal.sh)"\n' >"$work/bin/nvidia-smi"
chmod +x "$work/bin/"*
# gpu.sh's default order, its GPU tests included (on the CPU, a GPU's code paths)
order=${ORDER:-$(bash "$work/repo/benchmarks/gpu.sh" --default-order)}
# through the device call's own command (benchmarks/gpu_device.sh: no wheels here, PYTHONPATH
# the clone's src; it keeps gpu.sh's output as $out/log.txt, its own lines go to device.txt)
PATH="$work/bin:$PATH" TMPDIR="$work/tmp" ORDER="$order" OUT="$out" \
    bash "$work/repo/benchmarks/gpu_device.sh" >/dev/null 2>"$out/device.txt" || true
# with the GPU tests: every engine and method test on a GPU's code paths, beyond gpu.sh's
# selection (a GPU session has no time for them all; about 2.5 minutes here)
if [[ " $order " == *" tests "* ]]; then
    rc=0
    (cd "$work/repo" && FEDFORGET_TEST_GPU_PATHS=1 PYTHONPATH="$work/repo/src" TMPDIR="$work/tmp" \
        "$real" -m pytest -q -p no:cacheprovider -n 2 tests/methods tests/test_vectorized.py tests/test_engine.py \
        tests/test_resume.py tests/test_dropout.py tests/test_inputs.py tests/test_precision.py tests/test_continual.py \
        tests/test_diagnostics.py tests/test_models.py tests/test_models_paper.py tests/test_featcache.py tests/test_models_hf.py \
        >"$out/tests-gpu-paths.txt" 2>&1) || rc=$?
    echo "[tests-gpu-paths] done (rc $rc): the engine and method tests on a GPU's code paths" >>"$out/log.txt"
fi
# the step after gpu.sh (its header, section rates): each paper table's hours at this run's rates
rates=""  # in gpu.sh's order: hf-rates-c1.json's rows replace model_rates.json's
for f in model_rates.json hf-rates-c1.json; do [ -f "$out/$f" ] && rates="$rates $out/$f"; done
if [ -n "$rates" ]; then
    set +e
    # shellcheck disable=SC2086  # the files' paths: one word each
    PYTHONPATH="$work/repo/src" "$real" "$work/repo/benchmarks/paper_runtime.py" --model-rates $rates \
        --json "$out/paper_runtime.json" >"$out/paper_runtime.txt" 2>&1
    echo "[paper_runtime] done (rc $?): python benchmarks/paper_runtime.py --model-rates $rates" >>"$out/log.txt"
    set -e
fi
# what failed: a command's non-zero exit, an engine mode's error, a Python traceback
grep -h -E "done \(rc [^0]|  error: |^Traceback|Error:|^FAILED " "$out/log.txt" "$out"/*.txt 2>/dev/null | grep -v gpuGetDeviceCount \
    | sort | uniq -c | tee "$out/failures.txt"
if [ -s "$out/failures.txt" ]; then
    echo "gpu_rehearsal: $(grep -c '' "$out/calls.txt") commands; failures above (also $out/failures.txt)"
else
    echo "gpu_rehearsal: $(grep -c '' "$out/calls.txt") commands; no failure"
fi
