#!/usr/bin/env bash
# Device: build with -lineinfo, time the pre-pass in the sage bench, and list the pre-pass
# kernel's hottest source lines (ncu warp-stall samples) at D=128, N=$1 (default 4096).
set -uo pipefail
n=${1:-4096}
cmake -S . -B build-li -DCMAKE_BUILD_TYPE=Release -DSAGE_CUDA_ARCHS=90a -DCMAKE_CUDA_FLAGS=-lineinfo \
  -DPython3_EXECUTABLE="$(command -v python3)" > "$OUT/li-build.log" 2>&1 &&
  cmake --build build-li -j"$(nproc)" >> "$OUT/li-build.log" 2>&1 || { tail -30 "$OUT/li-build.log"; exit 1; }
ncu --kernel-name regex:prepass --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section SourceCounters --section WarpStateStats --import-source yes -o "$OUT/prepass" -f \
  ./build-li/sage bench --variants sage-8b --dims 128 --seqs "$n" --causal 0 --seconds 0.05 \
  --accuracy-rows 16 > "$OUT/ncu-run.log" 2>&1
ncu --import "$OUT/prepass.ncu-rep" --page source --csv --print-source cuda > /tmp/src.csv 2>&1
python3 scripts/dev/ncu_hot_lines.py /tmp/src.csv 40
ncu --import "$OUT/prepass.ncu-rep" --page details | grep -E "Duration|DRAM Through|Stall|Warp Cycles" | head -20
