#!/usr/bin/env bash
# Build stepmtp for several CPU feature levels and measure, per build, what the bundled
# model's statistics do: greedy acceptance (python -m stepmtp.models --bench), the
# bundled model's tests and the CI gate on the tiny agree model (exact counts).
#
#   tools/cpu_variants.sh [OUT] [VARIANT...]     # default OUT: /tmp/stepmtp-cpu-variants
#
# Each variant gets its own venv (OUT/venv-NAME) and its own CMake build directory
# (build/cpu-NAME, shared with ccache), so the checkout's own build is left alone.
# GGML_NATIVE compiles llama.cpp's CPU kernels for the build machine; other kernels
# round differently, the bundled model's greedy text changes and with it every count.
# A variant whose instructions this CPU lacks is skipped (an AVX-512 build needs an
# AVX-512 CPU to run). The table of builds in docs/bundled-model.md is
# what this printed on the project's machine.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-/tmp/stepmtp-cpu-variants}
shift || true

declare -A ARGS=(
    [native]=""
    [avx512]="-DGGML_NATIVE=OFF -DGGML_AVX512=ON"
    [avx2]="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    [avx2-nollamafile]="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_LLAMAFILE=OFF"
    [avx]="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF"
    [sse]="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF"
)
# the CPU flag each variant needs to run
declare -A NEEDS=([avx512]=avx512f [avx2]=avx2 [avx2-nollamafile]=avx2 [avx]=avx)
VARIANTS=("$@")
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(native avx512 avx2 avx2-nollamafile avx sse)

export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache} CCACHE_BASEDIR=$ROOT CCACHE_NOHASHDIR=1
mkdir -p "$OUT"
for name in "${VARIANTS[@]}"; do
    if [ -z "${ARGS[$name]+x}" ]; then
        echo "unknown variant $name (known: ${!ARGS[*]})" >&2; exit 2
    fi
    need=${NEEDS[$name]:-}
    if [ -n "$need" ] && ! grep -qw "$need" /proc/cpuinfo; then
        echo "== $name: skipped, this CPU has no $need"; continue
    fi
    d=$OUT/$name; mkdir -p "$d"
    echo "== $name: CMAKE_ARGS='${ARGS[$name]}' (log: $d/build.log)"
    (python3 -m venv "$OUT/venv-$name" && . "$OUT/venv-$name/bin/activate" &&
        python -m pip install -q --upgrade pip &&
        CMAKE_ARGS="${ARGS[$name]}" python -m pip install -v "$ROOT[test]" \
            --config-settings=build-dir="build/cpu-$name") >"$d/build.log" 2>&1 \
        || { echo "   build failed"; continue; }
    # run outside the checkout, so that import stepmtp is the venv's build
    (cd "$d" && . "$OUT/venv-$name/bin/activate" &&
        python -c "import stepmtp; print(stepmtp.__file__); print(stepmtp.system_info()['backend'])" &&
        python -m stepmtp.models --bench -t 1 | tail -n +2 | tee bench.txt &&
        { python -m pytest -q -p no:cacheprovider "$ROOT/tests/test_default_model.py" >pytest.txt 2>&1;
          echo "   tests: $(tail -1 pytest.txt)"; } &&
        { python -m stepmtp.bench --baseline "$ROOT/bench/baselines/ci-tiny-agree.json" -q >gate.txt 2>&1;
          echo "   CI $(grep '^gate:' gate.txt)"; })
done
