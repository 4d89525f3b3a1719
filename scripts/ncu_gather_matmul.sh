#!/usr/bin/env bash
# ncu on the fused gather and 1x1 product at 5 % and 50 % active, fp16 (and fp32 at 50 %).
# Reports go to $OUT (or /tmp). Usage: bash scripts/ncu_gather_matmul.sh [tile]
out=${OUT:-/tmp}
tile=${1:-128,64,16,3,4}
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section SourceCounters"
run() {  # name, script arguments...
  local name=$1
  shift
  timeout 120 ncu --clock-control none --kernel-name "regex:gather_matmul" --launch-skip 2 --launch-count 1 $sections \
    python3 scripts/profile_gather_matmul.py --tile "$tile" "$@" > "$out/ncu_gather_matmul_$name.txt" 2>&1
  echo "== $name (rc $?)"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Bank Conflicts|Block Limit|Stall|Waves Per SM|Excessive|uncoalesced" "$out/ncu_gather_matmul_$name.txt" | head -40
}
run fp16_50 --dtype float16 --active 0.5
run fp16_05 --dtype float16 --active 0.05
