#!/usr/bin/env bash
# The command of a device call (the `run` tool; /work/.library/device/README.md): installs the
# wheels benchmarks/gpu_wheels.sh put in .whl/ (carried), then runs benchmarks/gpu.sh into
# $OUT, its whole output kept as $OUT/log.txt, then benchmarks/gpu_targets.py on it
# (targets.json); BUDGET and ORDER pass through to gpu.sh:
#     run: command "BUDGET=480 bash benchmarks/gpu_device.sh", carry [".whl"], timeout_s 570
#     run: command "BUDGET=200 ORDER='continual18 vgg11 stream packing rates'
#          bash benchmarks/gpu_device.sh", carry [".whl"]   (the second, with what is left)
# then copy the files that come back to benchmarks/results/<device>-<date>/ (a second call's
# into a folder of its own), give the machine back, and read issue 32's targets off them:
#     python benchmarks/gpu_targets.py <first folder> <second folder> --json <first folder>/targets.json
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:?OUT: the folder a device call brings back (set by the run tool)}
mkdir -p "$out"
cd "$root"
site=/tmp/fedforget-site
wheels=${WHEEL_DIR:-.whl}  # as gpu_wheels.sh names it
if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl || { echo "gpu_device.sh: the wheels in $wheels/ did not install" >&2; exit 1; }
    export PYTHONPATH="$site:$root/src"
else
    echo "gpu_device.sh: no $wheels/ carried (benchmarks/gpu_wheels.sh): jsonschema and mnist1d may be missing" >&2
    export PYTHONPATH="$root/src"
fi
# gpu.sh calls `python`; where the image has only python3, a link to it goes first on PATH
if ! command -v python >/dev/null; then
    mkdir -p /tmp/fedforget-bin && ln -sf "$(command -v python3)" /tmp/fedforget-bin/python
    export PATH="/tmp/fedforget-bin:$PATH"
fi
export PYTHONUNBUFFERED=1
python -c "import fedforget, jsonschema, mnist1d" || echo "gpu_device.sh: an import above failed" >&2
bash "$root/benchmarks/gpu.sh" "$out" 2>&1 | tee "$out/log.txt"
status=$?  # gpu.sh's (pipefail)
# issue 32's targets as far as this call measured them (the reply's tail shows them)
python "$root/benchmarks/gpu_targets.py" "$out" --json "$out/targets.json"
exit $status
