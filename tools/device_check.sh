#!/usr/bin/env bash
# One-shot check on a machine with a GPU, in under 8 minutes, from a bundle built on a CPU machine
# (tools/device_bundle.sh: the ggml-hybrid wheel with its CUDA or Vulkan backend, and the wheels of cffi and gguf).
#
#   bash tools/device_check.sh [BUNDLE_DIR] [OUT_DIR]        (defaults: build/device_bundle, $OUT or build/device_out)
#
# 1. installs the bundle's wheels into a scratch folder (no network: --no-index), on the machine's python3;
#    a Vulkan bundle: Debian's Vulkan loader from the bundle where the machine has none, and NVIDIA's Vulkan driver
#    named by a driver file (VK_DRIVER_FILES) where a container has the driver's library but not its file;
# 2. runs tests/test_gpu.py and tests/test_gpu_experts.py from outside the checkout (so `import ggml_hybrid` is the
#    installed wheel), and for a Vulkan bundle tests/test_vulkan_backend.py and tests/test_vulkan_parity.py
#    (llama.cpp's Vulkan logits: those fixtures were recorded on lavapipe and are skipped on another Vulkan device);
# 3. runs tools/device_check.py: parity by tools/parity.py's rules (GPU against CPU, the cache at share 0 against
#    resident) and the hybrid benchmark (share 0, 0.5, auto);
# 4. leaves device_report.json, device_report.md, test_gpu.xml and the logs in OUT_DIR.
# Exit status: 0 when every test and parity check passed. On lavapipe (Mesa's Vulkan on the CPU, to check a Vulkan
# bundle without a GPU): GGML_VK_VISIBLE_DEVICES=0 DEVICE_CHECK_ARGS=--small DEVICE_CHECK_PYTEST_TIMEOUT=600 \
#   bash tools/device_check.sh build/device_bundle_vulkan (lavapipe runs the tests on the CPU: minutes, not seconds)
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUNDLE="$(cd "${1:-$REPO/build/device_bundle}" && pwd)" || { echo "error: no bundle folder ${1:-build/device_bundle}"; exit 2; }
OUT_DIR="${2:-${OUT:-$REPO/build/device_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python3}"
SITE="${GGML_HYBRID_DEVICE_SITE:-/tmp/ggml_hybrid_site}"
SCRATCH="$(mktemp -d)"
started=$(date +%s)
say() { echo "[device_check.sh +$(( $(date +%s) - started ))s] $*"; }

tag="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
wheel="$(ls "$BUNDLE"/ggml_hybrid-*-"$tag"-"$tag"-linux_x86_64.whl 2>/dev/null | head -1)"
if [ -z "$wheel" ]; then
    echo "error: the bundle has no ggml-hybrid wheel for $tag ($("$PY" --version)); it has:"; ls "$BUNDLE"; exit 2
fi
say "installing $(basename "$wheel") and $(ls "$BUNDLE"/*.whl | grep -vc ggml_hybrid) dependency wheel(s) into $SITE"
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$BUNDLE"/*.whl || exit 2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

tests=("$REPO/tests/test_gpu.py" "$REPO/tests/test_gpu_experts.py")
if "$PY" -m zipfile -l "$wheel" | grep 'backends/libggml-vulkan.so' >/dev/null; then  # (grep -q: a broken pipe)
    tests+=("$REPO/tests/test_vulkan_backend.py" "$REPO/tests/test_vulkan_parity.py")
    if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 '; then
        deb="$(ls "$BUNDLE"/debs/libvulkan1_*.deb 2>/dev/null | head -1)"
        if [ -n "$deb" ]; then
            say "no Vulkan loader on this machine: using $(basename "$deb") from the bundle"
            mkdir -p "$SCRATCH/vk"
            if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$deb" "$SCRATCH/vk"; else
                (cd "$SCRATCH/vk" && ar x "$deb" && tar xf data.tar.* ); fi
            export LD_LIBRARY_PATH="$SCRATCH/vk/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
    icds="$(ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null | grep -ci nvidia || true)"
    nv_lib="$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0 / {print $NF; exit}')"
    if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && [ "$icds" = 0 ] && [ -n "$nv_lib" ]; then
        # NVIDIA's Vulkan driver is its GLX library; a container given the driver's libraries may lack its JSON file
        printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' \
            "$nv_lib" > "$SCRATCH/nvidia_icd.json"
        export VK_DRIVER_FILES="$SCRATCH/nvidia_icd.json"
        say "NVIDIA's Vulkan driver named by $VK_DRIVER_FILES ($nv_lib)"
    fi
    export GGML_HYBRID_TEST_GPU=Vulkan0
    env | grep -E '^(VK_|GGML_VK_)' | tee -a "$OUT_DIR/devices.txt" || true
fi

cd "$SCRATCH" || exit 2
"$PY" -c 'import ggml_hybrid, sys; print("ggml_hybrid from", ggml_hybrid.__file__)' | tee "$OUT_DIR/devices.txt"
"$PY" -c 'import sys; from ggml_hybrid.cli import main; sys.argv = ["ggml-hybrid", "devices"]; main()' 2>&1 \
    | tee -a "$OUT_DIR/devices.txt"

say "${tests[*]##*/}"
timeout "${DEVICE_CHECK_PYTEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --rootdir "$REPO" "${tests[@]}" \
    --junitxml "$OUT_DIR/test_gpu.xml" 2>&1 | tee "$OUT_DIR/test_gpu.log"
tests_rc=${PIPESTATUS[0]}

say "parity and the hybrid benchmark"
# shellcheck disable=SC2086  # DEVICE_CHECK_ARGS: extra options, e.g. --small on lavapipe (a CPU playing the GPU)
timeout 240 "$PY" "$REPO/tools/device_check.py" --out "$OUT_DIR" --junit "$OUT_DIR/test_gpu.xml" ${DEVICE_CHECK_ARGS:-} 2>&1 \
    | tee "$OUT_DIR/device_check.log"
check_rc=${PIPESTATUS[0]}
rm -rf "$OUT_DIR/work" "$SCRATCH"

say "done: pytest exit $tests_rc, device_check.py exit $check_rc"
[ -f "$OUT_DIR/device_report.md" ] && cat "$OUT_DIR/device_report.md"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
