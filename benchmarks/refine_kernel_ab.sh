#!/bin/bash
# The refine kernel's standalone driver (benchmarks/refine_kernel_driver.cpp) built from the
# kernel sources of git revision REV and from the work tree, run alternately ROUNDS times for
# bfloat16 and float32 stores, from memory and in cache (one layer's stores 30 times), 2 threads;
# one JSON object of every run (median and fastest ms of a 30-layer step) on stdout. Alternating
# within a minute is what makes an A/B readable on a host whose memory bandwidth moves by 1.5x
# from one minute to the next (issue 51).
#
#   bash benchmarks/refine_kernel_ab.sh REV [ROUNDS] > docs/results/<name>.json
#   VIS=1 bash benchmarks/refine_kernel_ab.sh REV ...   # the driver's other modes (VIS, HUGE) pass
#                                                       # through the environment; both sides get them
set -euo pipefail
rev=${1:?usage: refine_kernel_ab.sh REV [ROUNDS]}
rounds=${2:-3}
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/old"
for f in refine_attention.cpp cpu_common.h; do git -C "$root" show "$rev:runtime/csrc/$f" > "$tmp/old/$f"; done
flags=(-O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math)
sed "s#../runtime/csrc/refine_attention.cpp#$tmp/old/refine_attention.cpp#" "$root/benchmarks/refine_kernel_driver.cpp" > "$tmp/old/driver.cpp"
g++ "${flags[@]}" -I"$tmp/old" "$tmp/old/driver.cpp" -o "$tmp/old_driver"
g++ "${flags[@]}" -I"$root/runtime/csrc" "$root/benchmarks/refine_kernel_driver.cpp" -o "$tmp/new_driver"
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "{\"command\": \"bash benchmarks/refine_kernel_ab.sh $rev $rounds\", \"old\": \"$rev\","
echo " \"new\": \"$(git -C "$root" rev-parse --short HEAD) + work tree\", \"cpu\": \"$cpu\", \"threads\": 2, \"runs\": ["
first=1
for round in $(seq "$rounds"); do
  for side in old new; do
    for env in "" "SAME=1" "F32=1" "F32=1 SAME=1"; do
      line=$(env $env JSON=1 OMP_NUM_THREADS=2 "$tmp/${side}_driver" 60 | tail -1)
      [ $first = 1 ] || echo ","
      first=0
      echo -n "  {\"round\": $round, \"kernel\": \"$side\", ${line#\{}"
    done
  done
done
echo "]}"
