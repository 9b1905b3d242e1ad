#!/usr/bin/env bash
# One kvlink engine pair on 1, 2, 4, ... threads per side against as many
# iperf3 processes at once (one stream each, summed), in one session:
#
#   bench/run_threads.sh [path/to/kvlink-bench] [--threads 1,2,4,8] [--prompts 128,32K]
#
# For each N: N iperf3 client/server pairs run at once on loopback (iperf3
# 3.12 runs all streams of one process on one thread, so N processes is the
# reference for N cores), then `kvlink-bench kv --threads N --lanes max(N,2)`
# for WRITE and READ, contiguous and scattered block ids. Prints a markdown
# table: GB/s (10^9 B/s) and kvlink / iperf3 for the same N.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
bench="$here/../build/dev/bench/kvlink-bench"
if [[ $# -gt 0 && "$1" != --* ]]; then bench="$1"; shift; fi
threads="1,2,4,8"
prompts="128,32K"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --threads) threads="$2"; shift 2 ;;
    --prompts) prompts="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[[ -x "$bench" ]] || { echo "kvlink-bench not found at $bench (pass its path)" >&2; exit 2; }
command -v iperf3 >/dev/null || { echo "iperf3 is needed (apt-get install iperf3)" >&2; exit 2; }
py=/usr/bin/python3
[[ -x $py ]] || py=python3

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"; kill $(jobs -p) 2>/dev/null || true' EXIT

# N iperf3 processes at once, one stream each; prints the summed receiver GB/s.
iperf_sum() {
  local n="$1" base=$((16201 + RANDOM % 2000)) pids=()
  for ((i = 0; i < n; i++)); do
    iperf3 -s -1 -p $((base + i)) >/dev/null 2>&1 &
  done
  sleep 0.5
  for ((i = 0; i < n; i++)); do
    iperf3 -c 127.0.0.1 -p $((base + i)) -t 5 -J >"$tmp/ip$i.json" 2>/dev/null &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  wait || true
  $py - "$tmp" "$n" <<'EOF'
import json, sys, os
total = 0.0
for i in range(int(sys.argv[2])):
    try:
        j = json.load(open(os.path.join(sys.argv[1], f"ip{i}.json")))
        total += j["end"]["sum_received"]["bits_per_second"] / 8e9
    except Exception:
        pass
print(f"{total:.3f}")
EOF
}

echo "| threads per side | iperf3 processes, GB/s | op | block ids | prompt | kvlink GB/s | kvlink / iperf3 |"
echo "|---:|---:|---|---|---:|---:|---:|"
IFS=, read -r -a ns <<<"$threads"
for n in "${ns[@]}"; do
  ref=$(iperf_sum "$n")
  lanes=$((n > 2 ? n : 2))
  for op in write read; do
    for blocks in contiguous scattered; do
      "$bench" kv --threads "$n" --lanes "$lanes" --prompts "$prompts" --op "$op" \
        --blocks "$blocks" --line-rate "$ref" --iterations 3 --csv >"$tmp/kv.csv" 2>/dev/null || true
      $py - "$tmp/kv.csv" "$n" "$ref" "$op" "$blocks" <<'EOF'
import csv, sys
path, n, ref, op, blocks = sys.argv[1:]
rows = list(csv.DictReader(open(path)))
if not rows:
    print(f"| {n} | {ref} | {op} | {blocks} | - | failed | - |")
for r in rows:
    gb = float(r["gb_per_s"]) if r["gb_per_s"] else 0.0
    ratio = gb / float(ref) if float(ref) > 0 else 0.0
    prompt = int(r["prompt_tokens"])
    label = f"{prompt // 1024}K" if prompt >= 1024 and prompt % 1024 == 0 else str(prompt)
    print(f"| {n} | {ref} | {op} | {blocks} | {label} | {gb:.2f} | {ratio:.2f} |")
EOF
    done
  done
done
