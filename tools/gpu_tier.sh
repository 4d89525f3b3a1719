#!/usr/bin/env bash
# The GPU tier in one call: backend, demo, the test suite on the device, then the
# same suite under compute-sanitizer memcheck. Logs go to $OUT (or /tmp).
# Usage: [PYTEST_TIMEOUT=s] [MEMCHECK_TIMEOUT=s] bash tools/gpu_tier.sh [--help] [pytest args...]
# (memcheck of the whole suite takes longer than one device call: tools/memcheck_shards.py)
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
unset NUMBA_ENABLE_CUDASIM
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m sparseblocks info
python3 -m sparseblocks demo || echo "DEMO FAILED"
timeout "${PYTEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" 2>&1 | tee "$out/pytest_gpu.log" | tail -n 25
echo "pytest rc=${PIPESTATUS[0]}"
SPARSEBLOCKS_HYPOTHESIS_PROFILE=ci timeout "${MEMCHECK_TIMEOUT:-280}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
  python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$out/memcheck.log" | tail -n 12
echo "memcheck rc=${PIPESTATUS[0]}"
