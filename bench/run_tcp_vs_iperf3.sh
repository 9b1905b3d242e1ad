#!/usr/bin/env bash
# Compares kvlink_tcp_bench with iperf3 over loopback in one session.
#
#   bench/run_tcp_vs_iperf3.sh [path/to/kvlink_tcp_bench] [extra kvlink_tcp_bench options...]
#
# Installs nothing. If iperf3 is on PATH, runs `iperf3 -s -1` with
# `iperf3 -c 127.0.0.1 -t 5 -J` at -P 2 and -P 1 and takes the receiver's
# bits/s from the JSON (python3 parses it); then runs kvlink_tcp_bench --csv
# and prints each row with kvlink / iperf3 (two streams) and kvlink / iperf3
# (one stream). GB/s = 10^9 bytes/s.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
bench="${1:-}"
if [[ -z "$bench" || "$bench" == --* ]]; then
  bench="$here/../build-bench/bench/kvlink_tcp_bench"
else
  shift
fi
[[ -x "$bench" ]] || { echo "kvlink_tcp_bench not found at $bench (pass its path)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "python3 is needed to parse the results" >&2; exit 2; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# iperf3 run with $1 parallel streams; prints "sender_GBps receiver_GBps".
iperf_run() {
  local streams="$1" port=$((15201 + RANDOM % 1000))
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  if ! iperf3 -c 127.0.0.1 -p "$port" -P "$streams" -t 5 -J >"$tmp/iperf$streams.json" 2>/dev/null; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    echo "0 0"
    return
  fi
  wait "$server" 2>/dev/null || true
  python3 - "$tmp/iperf$streams.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
end = j["end"]
print(f'{end["sum_sent"]["bits_per_second"] / 8e9:.3f} {end["sum_received"]["bits_per_second"] / 8e9:.3f}')
EOF
}

ip2_rx=0
ip1_rx=0
if command -v iperf3 >/dev/null; then
  read -r ip2_tx ip2_rx < <(iperf_run 2)
  read -r ip1_tx ip1_rx < <(iperf_run 1)
  echo "iperf3 loopback -P 2: sender ${ip2_tx} GB/s, receiver ${ip2_rx} GB/s"
  echo "iperf3 loopback -P 1: sender ${ip1_tx} GB/s, receiver ${ip1_rx} GB/s"
else
  echo "iperf3 not found: printing kvlink figures only" >&2
fi

"$bench" --csv "$@" >"$tmp/kvlink.csv"

python3 - "$tmp/kvlink.csv" "$ip2_rx" "$ip1_rx" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
p2, p1 = float(sys.argv[2]), float(sys.argv[3])
def ratio(v, base):
    return f"{v / base:.2f}" if base > 0 else "-"
if rows:
    r = rows[0]
    print(f"# kvlink: lanes={r['lanes']} slice_size={r['slice_size']} "
          f"max_inflight_per_lane={r['max_inflight_per_lane']} socket_buffer={r['socket_buffer']} "
          f"depth={r['depth']}; iperf3 receiver: -P2 {p2:.2f} GB/s, -P1 {p1:.2f} GB/s")
print(f"{'op':<6} {'block':>9} {'batch':>6} {'GB/s':>8} {'GiB/s':>8} {'/iperf3 P2':>11} {'/iperf3 P1':>11}")
for r in rows:
    block = int(r["block_bytes"])
    label = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
    if r["error"]:
        print(f"{r['op']:<6} {label:>9} {r['batch']:>6} error: {r['error']}")
        continue
    g = float(r["gb_per_s"])
    print(f"{r['op']:<6} {label:>9} {r['batch']:>6} {g:>8.2f} {float(r['gib_per_s']):>8.2f} "
          f"{ratio(g, p2):>11} {ratio(g, p1):>11}")
EOF
