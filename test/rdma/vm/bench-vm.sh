#!/usr/bin/env bash
# kvlink RDMA WRITE against ib_write_bw (perftest), in one two-VM run, on the
# same device (rxe0, rail 0) with the same message sizes. Prints a table of
# GB/s (10^9 bytes per second) and the ratio kvlink / ib_write_bw.
# Software RDMA in an emulated VM is slow in absolute terms: only the ratio
# means anything.
#
# Usage: bench-vm.sh PATH/TO/kvlink_rdma_vm_test [SIZE...]   (bytes; default
#        65536 1048576 16777216)
# Both use 2 RC queue pairs (kvlink's default rdma_qps_per_endpoint;
# ib_write_bw -q 2) and one device. ib_write_bw reports its average over
# max(96 MiB / SIZE, 10) messages; kvlink the median of 3 transfers of
# 32 MiB cut into SIZE-byte requests.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${1:?usage: bench-vm.sh PATH/TO/kvlink_rdma_vm_test [SIZE...]}
shift
sizes=${*:-65536 1048576 16777216}
"$here/build-vm.sh" "$bin" || exit 1
log=$(mktemp)
# shellcheck disable=SC2016
"$here/run-vm.sh" --timeout 900 --smp 2 -- "
sizes='$sizes'"'
gid=$(roce-v2-gid rxe0)
i=0
if [ "$KVLINK_ROLE" = server ]; then
  kvlink_rdma_vm_test bench-server & srv=$!
  for s in $sizes; do
    n=$((100663296 / s)); [ $n -lt 10 ] && n=10
    ib_write_bw -d rxe0 -x $gid -p $((18515 + i)) -s $s -n $n -q 2 -F --report_gbits >/dev/null 2>&1
    i=$((i + 1))
  done
  wait $srv
  exit $?
fi
for s in $sizes; do
  n=$((100663296 / s)); [ $n -lt 10 ] && n=10
  k=0
  until out=$(ib_write_bw -d rxe0 -x $gid -p $((18515 + i)) -s $s -n $n -q 2 -F --report_gbits $KVLINK_PEER0 2>&1); do
    k=$((k + 1)); [ $k -ge 40 ] && { echo "ib_write_bw $s failed: $out"; exit 1; }
    sleep 0.5
  done
  # The result row: bytes, iterations, peak Gb/s, average Gb/s, Mpps.
  echo "$out" | awk -v s=$s '"'"'$1 == s && NF >= 4 {printf "perftest %s %.6f GBps\n", s, $4 / 8}'"'"'
  i=$((i + 1))
done
kvlink_rdma_vm_test bench $sizes' | tee "$log"
status=${PIPESTATUS[0]}
echo
echo "| message | ib_write_bw GB/s | kvlink GB/s | kvlink / ib_write_bw |"
echo "|---|---|---|---|"
for s in $sizes; do
  p=$(grep -ao "perftest $s [0-9.]*" "$log" | awk '{print $3}' | tail -n1)
  k=$(grep -ao "kvlink $s [0-9.]*" "$log" | awk '{print $3}' | tail -n1)
  awk -v s="$s" -v p="${p:-0}" -v k="${k:-0}" 'BEGIN {
    printf "| %d KiB | %.4f | %.4f | %s |\n", s / 1024, p, k, (p > 0 ? sprintf("%.2f", k / p) : "-") }'
done
rm -f "$log"
exit "$status"
