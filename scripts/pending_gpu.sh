#!/usr/bin/env bash
# What the eleventh session built without a GPU and left to measure, in two device calls of
# under 10 minutes each: `tests`, the GPU tests of the changed paths and the same under
# memcheck; `timing`, the forward through a transposed copy of W against the default
# (V5_TRANSPOSED_FORWARD) and reduce_mask's versions after the row loop's rewrite. Logs and
# tables go to $OUT (or /tmp).
# Usage: bash scripts/pending_gpu.sh tests|timing
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
unset NUMBA_ENABLE_CUDASIM
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${1:-}" = tests ]; then
  timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_bsmm.py tests/test_sbnet.py \
  -k "transpose or replay or bad_input or reduce_mask" 2>&1 | tee "$out/pending_tests.log" | tail -n 5
  SPARSEBLOCKS_HYPOTHESIS_PROFILE=ci timeout 300 compute-sanitizer --tool memcheck --report-api-errors no \
  --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider tests/test_bsmm.py tests/test_sbnet.py \
  -k "transpose or replay or tall or large_masks" 2>&1 | tee "$out/pending_memcheck.log" | tail -n 5
  echo "memcheck rc=${PIPESTATUS[0]}"
  exit 0
fi
for n in 16384 4096; do
  timeout 230 python3 scripts/bsmm_variants.py --variants "v5,v5 transposed forward" --products forward,input_grad \
    --densities 0.1,0.5 --block-sizes 16,64 --rows "$n" > "$out/transposed_forward_$n.txt" 2>&1
  grep "^|" "$out/transposed_forward_$n.txt"
done
timeout 90 python3 scripts/reduce_mask_variants.py --out "$out" > "$out/reduce_mask_variants.txt" 2>&1
grep "^|" "$out/reduce_mask_variants.txt"
