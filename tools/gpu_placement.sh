#!/usr/bin/env bash
# Issue 34's device check: the bench model with every layer on the GPU but the first N
# layers' MoE experts in host memory (-ngl all --n-cpu-moe N), MTP on against off, with
# f16 and q8_0 KV caches; then the server flags (-ot, --cpu-moe, --no-mmap) on the
# GPU. Run on the device machine through the shared runner (its run.sh is read-only):
#
#   bash .gpu/run.sh bash tools/gpu_placement.sh [N]      # N: default 3
#
# Writes the bench's tables (tok/s, acceptance, KV bytes, whether the texts agree) to
# $OUT/placement-*.md and stops at the first failing run.
set -uo pipefail
N=${1:-3}
OUT=${OUT:-/tmp}
for kv in f16 q8_0; do
    echo "== -ngl all --n-cpu-moe $N, KV $kv: MTP off against on"
    python3 -m stepmtp.bench --bench-model -ngl all --n-cpu-moe "$N" -ctk "$kv" -ctv "$kv" \
        --configs none,chain-3,single-3 -q --limit 5 --markdown "$OUT/placement-$kv.md" || exit $?
done
echo "== the server with the issue's flags"
python3 -m stepmtp.bench --bench-model --server -ctk q8_0 -ctv q8_0 -cmoe -ncmoe 2 -ot exps=CPU --no-mmap \
    --configs none,chain-3 -q --limit 5 --markdown "$OUT/placement-server.md" || exit $?
