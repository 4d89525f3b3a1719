#!/usr/bin/env bash
# ncu on version 5's products at the issue's headline size (N = C = K = 4096, block 32,
# 10 %): fp16 and fp32 forward, fp32 weight gradient. Reports go to $OUT (or /tmp).
# Usage: bash scripts/ncu_v5.sh
out=${OUT:-/tmp}
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis"
run() {  # name, kernel regex, script arguments...
  local name=$1 regex=$2
  shift 2
  timeout 120 ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 3 --launch-count 1 $sections \
    python3 scripts/profile_bsmm.py --version 5 "$@" > "$out/ncu_$name.txt" 2>&1
  echo "== $name (rc $?)"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|No Eligible|Bank Conflicts|Block Limit" "$out/ncu_$name.txt" | head -30
}
run fwd_fp16 product --dtype float16
run fwd_fp32 product --dtype float32
run wgrad_fp32 weight_grad --dtype float32 --product weight_grad
