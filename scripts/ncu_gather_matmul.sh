#!/usr/bin/env bash
# ncu on the fused gather and 1x1 product (fp16) at 5 % and 50 % active: throughputs, occupancy and
# the warps' stall reasons. Reports go to $OUT (or /tmp). Usage: bash scripts/ncu_gather_matmul.sh [tile [format]]
# (format NCHW: the NCHW image's kernel, whose tile has 2 stages: 128,64,16,2,4)
out=${OUT:-/tmp}
tile=${1:-128,64,16,3,4}
format=${2:-NHWC}
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section SourceCounters"
stalls=""
for reason in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait lg_throttle not_selected selected dispatch_stall no_instruction branch_resolving; do
  stalls="$stalls,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio"
done
run() {  # name, script arguments...
  local name=$1
  shift
  timeout 120 ncu --clock-control none --kernel-name "regex:gather_matmul" --launch-skip 2 --launch-count 1 $sections \
    --metrics "${stalls#,},gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum" \
    python3 scripts/profile_gather_matmul.py --tile "$tile" --format "$format" "$@" > "$out/ncu_gather_matmul_$name.txt" 2>&1
  echo "== $name (rc $?)"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|No Eligible|Block Limit Reg|Block Limit Sha|Waves Per SM|excessive|stalled|dram__bytes|lts__t_sectors" "$out/ncu_gather_matmul_$name.txt" | head -40
}
run fp16_50 --dtype float16 --active 0.5
run fp16_05 --dtype float16 --active 0.05
