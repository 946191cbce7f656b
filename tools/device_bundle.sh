#!/usr/bin/env bash
# Build, on a CPU machine, what tools/device_check.sh installs on a GPU machine that has no network: the ggml-hybrid
# wheel for that machine's Python (portable CPU variants and a GPU backend), and the wheels of the dependencies it
# lacks (cffi, pycparser, gguf, tokenizers). Checks the total stays under 64 MiB (what the device tool carries).
#
#   PYTHON=~/.pyenv/versions/3.12.1/bin/python bash tools/device_bundle.sh [--vulkan] [OUT_DIR]
#
# The GPU backend: CUDA for sm_90 (needs nvcc here; default OUT_DIR build/device_bundle), or with --vulkan GGML's
# Vulkan backend (needs libvulkan-dev, glslc and spirv-headers here; default OUT_DIR build/device_bundle_vulkan),
# which runs through any Vulkan driver: NVIDIA's, AMD's, Intel's, Mesa's lavapipe. The Vulkan bundle also carries
# Debian's Vulkan loader (libvulkan1), for a machine whose driver came without it.
# GGML_HYBRID_PORTABLE=0 builds the CPU part for this CPU only (a check of the bundle on this machine, without the
# 15 CPU variants' build).
#
# PYTHON is the interpreter the wheel is for (the device's python3 minor version; 3.12 on the H200 machines);
# BUILD_PYTHON (default python3) makes the sdist and needs PyPA's build (pip install build).
# The first run builds the CUDA backend (hours on 2 shared cores) and the portable CPU variants; later runs
# take them from the build cache (python -m ggml_hybrid_build --print-cache).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
BACKEND=cuda
if [ "${1:-}" = "--vulkan" ]; then BACKEND=vulkan; shift; fi
if [ "$BACKEND" = vulkan ]; then OUT_DIR="${1:-$REPO/build/device_bundle_vulkan}"; else OUT_DIR="${1:-$REPO/build/device_bundle}"; fi
SWITCH="GGML_HYBRID_$(echo "$BACKEND" | tr '[:lower:]' '[:upper:]')"
PORTABLE="${GGML_HYBRID_PORTABLE:-1}"
PY="${PYTHON:-python3.12}"
BUILD_PY="${BUILD_PYTHON:-python3}"
LIMIT=$((60 * 1024 * 1024))  # leaves room for the checkout itself within the 64 MiB carried
ver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "== sdist of $REPO"
"$BUILD_PY" -m build --sdist --outdir "$tmp" "$REPO" >"$tmp/sdist.log" 2>&1 || { cat "$tmp/sdist.log"; exit 1; }
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"

echo "== ggml-hybrid wheel for Python $ver: CPU (portable=$PORTABLE) + $BACKEND backend"
start=$(date +%s)
env GGML_HYBRID_PORTABLE="$PORTABLE" "$SWITCH=1" "$PY" -m pip wheel -q --no-deps -w "$OUT_DIR" "$tmp"/ggml_hybrid-*.tar.gz
echo "   built in $(( $(date +%s) - start )) s"

if [ "$BACKEND" = vulkan ]; then
    echo "== Debian's Vulkan loader (libvulkan1), for a machine that has a Vulkan driver but no loader"
    mkdir -p "$OUT_DIR/debs"
    ( cd "$OUT_DIR/debs" && apt-get download libvulkan1 >/dev/null )
fi

echo "== dependency wheels the device lacks (no network there)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$ver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT_DIR" "cffi>=1.16" "pycparser" "gguf>=0.10" "tokenizers>=0.19"

total=$(find "$OUT_DIR" -type f \( -name '*.whl' -o -name '*.deb' \) -exec cat {} + | wc -c)
( cd "$OUT_DIR" && find . -type f \( -name '*.whl' -o -name '*.deb' \) | sort | xargs ls -l \
  && find . -type f \( -name '*.whl' -o -name '*.deb' \) | sort | xargs sha256sum ) | tee "$OUT_DIR/MANIFEST.txt"
unzip -l "$OUT_DIR"/ggml_hybrid-*.whl | grep -E '_native/(lib|backends)/|_ggml\.' | tee -a "$OUT_DIR/MANIFEST.txt"
echo "total $total bytes ($(( total / 1048576 )) MiB)" | tee -a "$OUT_DIR/MANIFEST.txt"
if [ "$total" -gt "$LIMIT" ]; then
    echo "error: the bundle is over $(( LIMIT / 1048576 )) MiB"
    exit 1
fi
unzip -l "$OUT_DIR"/ggml_hybrid-*.whl | grep -q "backends/libggml-$BACKEND.so" || { echo "error: no $BACKEND backend in the wheel"; exit 1; }
