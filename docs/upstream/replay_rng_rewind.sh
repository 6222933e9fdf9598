#!/usr/bin/env bash
# Reproducer: llama-server's checkpoint restore rewinds the rejection sampler's stream
# (common_sampler_copy copies gsmpl->rng), so after a replay the next verification reuses the
# uniforms that decided the replayed tokens. See replay-rng-rewind.md next to this file.
#
# usage: replay_rng_rewind.sh LLAMA_CPP_DIR PATCH [BUILD_DIR]
#   LLAMA_CPP_DIR  a llama.cpp source tree (b11434; left unchanged: the script works on a copy)
#   PATCH          replay-fix.patch (src/specaudit/patches/llama.cpp/b11434/ in specaudit)
#
# Builds tests/test-sampler-copy.cpp (from PATCH) twice in a copy of the tree: on the stock
# sources, where ctest reports it FAILED (exit 1 at the end), then with the one-line fix in
# common/sampling.cpp, where it passes. Needs cmake and a C++17 compiler; no model download (the
# test runs on the dummy llama model tests/test-llama-archs.cpp generates).
set -euo pipefail
src=$(cd "$1" && pwd)
patch=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
work=${3:-$(mktemp -d)}
jobs=${JOBS:-2}

mkdir -p "$work"
rm -rf "$work/llama.cpp"
cp -r "$src" "$work/llama.cpp"
rm -rf "$work/llama.cpp/build"
cd "$work/llama.cpp"

# the test and its ctest registration only: the stock sampler
git apply --include='tests/*' "$patch"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF >/dev/null
cmake --build build -j "$jobs" --target test-llama-archs test-sampler-copy >/dev/null
run() { (cd build && ctest -R 'test-generate-models|test-sampler-copy' --output-on-failure) | grep -E 'Test +#|main:|seed 1:|tests passed'; }
echo "== stock common_sampler_copy (expected: test-sampler-copy fails)"
stock=0; run || stock=$?

# the fix
git apply --include='common/*' "$patch"
cmake --build build -j "$jobs" --target test-sampler-copy >/dev/null
echo "== with the fix (expected: passes)"
fixed=0; run || fixed=$?

echo "stock ctest exit $stock, fixed ctest exit $fixed"
[ "$stock" -ne 0 ] && [ "$fixed" -eq 0 ]
