#!/usr/bin/env bash
# kvlink RDMA WRITE and READ against ib_write_bw and ib_read_bw (perftest), in
# one two-VM run, on the same device (rxe0, rail 0) with the same message
# sizes. Prints a table of GB/s (10^9 bytes per second) and the ratio
# kvlink / perftest. Software RDMA in an emulated VM is slow in absolute
# terms: only the ratios mean anything.
#
# Usage: bench-vm.sh PATH/TO/kvlink_rdma_vm_test [SIZE...]   (bytes; default
#        4096 16384 65536 1048576)
#   KVLINK_BENCH_BASELINE=PATH/TO/another/kvlink_rdma_vm_test (e.g. a build of
#   main) runs that build too, in the same VMs, right before this one: a
#   before/after comparison on the same emulated machines.
# Both use 2 RC queue pairs (kvlink's default rdma_qps_per_endpoint;
# perftest -q 2) and one device. perftest reports its average over
# max(96 MiB / SIZE, 10) messages; kvlink the median of 3 transfers of 32 MiB
# in SIZE-byte requests, either contiguous (adjacent: the planner coalesces
# them and cuts its own 1 MiB slices, so SIZE is not what goes on the wire)
# or scattered (a gap after each: one slice of SIZE bytes per request, small
# pieces on the wire). "CPU s/GB" is the kvlink process's CPU time (user +
# system) per GB moved, scattered: the emulated wire caps GB/s for every
# message size alike, the CPU a work request costs still shows. See `bench`
# in rdma_vm_test.cpp.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${1:?usage: bench-vm.sh PATH/TO/kvlink_rdma_vm_test [SIZE...]}
shift
sizes=${*:-4096 16384 65536 1048576}
programs=("$bin")
links=
if [[ -n ${KVLINK_BENCH_BASELINE:-} ]]; then
  # build-vm.sh names a program in the VM by the basename of its path.
  links=$(mktemp -d)
  ln -s "$(readlink -f "$KVLINK_BENCH_BASELINE")" "$links/kvlink_rdma_vm_test_baseline"
  programs+=("$links/kvlink_rdma_vm_test_baseline")
fi
"$here/build-vm.sh" "${programs[@]}" || exit 1
[[ -n $links ]] && rm -rf "$links"
log=$(mktemp)
# shellcheck disable=SC2016
"$here/run-vm.sh" --timeout 900 --smp 2 -- "
sizes='$sizes'"'
gid=$(roce-v2-gid rxe0)
builds=kvlink_rdma_vm_test
command -v kvlink_rdma_vm_test_baseline >/dev/null && builds="kvlink_rdma_vm_test_baseline $builds"
i=0
if [ "$KVLINK_ROLE" = server ]; then
  for tool in ib_write_bw ib_read_bw; do
    for s in $sizes; do
      n=$((100663296 / s)); [ $n -lt 10 ] && n=10
      $tool -d rxe0 -x $gid -p $((18515 + i)) -s $s -n $n -q 2 -F --report_gbits >/dev/null 2>&1
      i=$((i + 1))
    done
  done
  for b in $builds; do $b bench-server || exit $?; done
  exit 0
fi
for tool in ib_write_bw ib_read_bw; do
  for s in $sizes; do
    n=$((100663296 / s)); [ $n -lt 10 ] && n=10
    k=0
    until out=$($tool -d rxe0 -x $gid -p $((18515 + i)) -s $s -n $n -q 2 -F --report_gbits $KVLINK_PEER0 2>&1); do
      k=$((k + 1)); [ $k -ge 40 ] && { echo "$tool $s failed: $out"; exit 1; }
      sleep 0.5
    done
    # The result row: bytes, iterations, peak Gb/s, average Gb/s, Mpps.
    echo "$out" | awk -v t=$tool -v s=$s '"'"'$1 == s && NF >= 4 {printf "%s %s %.6f GBps\n", t, s, $4 / 8}'"'"'
    i=$((i + 1))
  done
done
for b in $builds; do
  # The baseline reports as "baseline...", this build as "kvlink...".
  tag=kvlink; [ $b = kvlink_rdma_vm_test_baseline ] && tag=baseline
  $b bench write contiguous $sizes scattered $sizes read scattered $sizes | sed "s/^kvlink/$tag/" || exit 1
  sleep 1
done' | tee "$log"
status=${PIPESTATUS[0]}
# The console lines are prefixed ("[client] "): match the tag and size alone.
get() { grep -ao "$1 $2 [0-9.]*" "$log" | awk '{print $3}' | tail -n1; }
cpu() { grep -ao "$1 $2 .*cpu [0-9.]*" "$log" | sed 's/.*cpu //' | tail -n1; }
ratio() { awk -v k="${1:-0}" -v p="${2:-0}" 'BEGIN { print (p > 0 && k > 0 ? sprintf("%.2f", k / p) : "-") }'; }
gbps() { awk -v v="${1:-0}" 'BEGIN { print (v > 0 ? sprintf("%.4f", v) : "-") }'; }
echo
base=$(grep -aq "baseline [0-9]" "$log" && echo yes)
if [[ -n $base ]]; then
  echo "| op | message | perftest GB/s | kvlink contiguous | kvlink scattered | scattered / perftest | CPU s/GB | baseline scattered | baseline / perftest | baseline CPU s/GB |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
else
  echo "| op | message | perftest GB/s | kvlink contiguous | kvlink scattered | scattered / perftest | CPU s/GB |"
  echo "|---|---|---|---|---|---|---|"
fi
for op in write read; do
  tool=ib_${op}_bw
  suffix=; [[ $op == read ]] && suffix=-read
  for s in $sizes; do
    p=$(get "$tool" "$s")
    c=$(get "kvlink$suffix" "$s")
    k=$(get "kvlink$suffix-scattered" "$s")
    row="| $op | $((s / 1024)) KiB | $(gbps "$p") | $(gbps "$c") | $(gbps "$k") | $(ratio "$k" "$p") | $(cpu "kvlink$suffix-scattered" "$s") |"
    if [[ -n $base ]]; then
      b=$(get "baseline$suffix-scattered" "$s")
      row+=" $(gbps "$b") | $(ratio "$b" "$p") | $(cpu "baseline$suffix-scattered" "$s") |"
    fi
    echo "$row"
  done
done
rm -f "$log"
exit "$status"
