#!/usr/bin/env bash
# Runs a command on two soft-RoCE VMs acting as two hosts, and returns its
# exit status.
#
# Usage: run-vm.sh [--timeout SECONDS] [--smp N] [--mem MiB] [--] COMMAND
#
# Two QEMU VMs (pure emulation, no KVM) boot the kernel and initramfs that
# build-vm.sh made. Each has two rails: two e1000 NICs, eth0 and eth1, joined
# pairwise to the other VM's by QEMU socket netdevs on 127.0.0.1 (nothing else
# is reachable from them). Rail 0 is 10.77.1.0/24 with rxe0 on eth0, rail 1 is
# 10.77.2.0/24 with rxe1 on eth1; host 1 is .1, host 2 is .2 on both.
#
# COMMAND is a shell command line run by sh on both hosts once both rails
# answer, with KVLINK_ROLE (server on host 1, client on host 2), KVLINK_HOST,
# KVLINK_SELF0/1 and KVLINK_PEER0/1 (IPv4 per rail) set. Programs given to
# build-vm.sh are in the PATH. Each VM prints
#   KVLINK-VM-EXIT host=N role=ROLE status=S
# on its console and powers off; the consoles are echoed prefixed [server] and
# [client] and kept in $KVLINK_VM_DIR/runs/.
#
# Exit status: the command's status (host 1's when it is not 0, else host
# 2's); 124 when the hard timeout (default 180 s) ended a VM; 1 when a VM
# gave no marker; 125 when setting up a VM failed; 77 with "SKIPPED: <reason>"
# when QEMU or the VM image is not available.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
vm_dir=${KVLINK_VM_DIR:-$repo/.vm}
timeout_s=180
smp=1
mem=1024

while (($#)); do
  case $1 in
    --timeout) timeout_s=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --) shift; break ;;
    -*) echo "usage: run-vm.sh [--timeout S] [--smp N] [--mem MiB] [--] COMMAND" >&2; exit 2 ;;
    *) break ;;
  esac
done
(($# > 0)) || { echo "usage: run-vm.sh [--timeout S] [--smp N] [--mem MiB] [--] COMMAND" >&2; exit 2; }
command_line="$*"

skip() { echo "SKIPPED: $*"; exit 77; }
qemu=$(command -v qemu-system-x86_64) || skip "qemu-system-x86_64 not installed (apt-get install qemu-system-x86)"
[[ -f $vm_dir/vmlinuz && -f $vm_dir/initrd.gz ]] ||
  skip "no VM image in $vm_dir (run test/rdma/vm/build-vm.sh first)"
[[ -r /proc/net/tcp ]] || skip "/proc/net/tcp unreadable: cannot place the socket netdevs"
for tool in cpio gzip timeout; do
  command -v "$tool" >/dev/null || skip "$tool not installed"
done

t_start=$EPOCHREALTIME
mkdir -p "$vm_dir/runs"
run=$(mktemp -d "$vm_dir/runs/run.XXXXXX")
# Keep the consoles of the last 20 runs.
ls -dt "$vm_dir"/runs/run.* 2>/dev/null | tail -n +20 | xargs -r rm -rf

# The command travels as a second cpio archive appended to the initramfs (the
# kernel unpacks concatenated archives in order).
mkdir -p "$run/job/job"
printf '%s\n' "$command_line" >"$run/job/job/cmd.sh"
(cd "$run/job" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) >"$run/job.gz"
cat "$vm_dir/initrd.gz" "$run/job.gz" >"$run/initrd.gz"

# Free TCP ports on loopback for the two rails.
port_listening() {
  local hex
  hex=$(printf '%04X' "$1")
  awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" {found=1} END {exit !found}' /proc/net/tcp /proc/net/tcp6
}
pick_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 40000))
    port_listening "$p" || { echo "$p"; return; }
  done
}
port0=$(pick_port)
port1=$(pick_port)
while [[ $port1 == "$port0" ]]; do port1=$(pick_port); done

pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

# start_vm HOST ROLE MODE: MODE is listen (host 1) or connect (host 2).
start_vm() {
  local host=$1 role=$2 mode=$3
  (
    timeout --kill-after=5 "$timeout_s" nice -n 10 "$qemu" \
      -accel tcg,thread=multi -cpu max -m "$mem" -smp "$smp" \
      -kernel "$vm_dir/vmlinuz" -initrd "$run/initrd.gz" \
      -append "console=ttyS0 quiet loglevel=3 panic=-1 no_timer_check kvlink.host=$host kvlink.role=$role" \
      -nographic -no-reboot -nic none \
      -netdev "socket,id=rail0,$mode=127.0.0.1:$port0" \
      -device "e1000,netdev=rail0,mac=52:54:00:77:0$host:00" \
      -netdev "socket,id=rail1,$mode=127.0.0.1:$port1" \
      -device "e1000,netdev=rail1,mac=52:54:00:77:0$host:01" </dev/null 2>&1
    echo "run-vm: qemu exit $?"
  ) | sed -u 's/\r$//' | tee "$run/host$host.log" |
    sed -u -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1bc//g' | show "$role" &
  pids+=($!)
}

# show ROLE: echoes console lines as "[ROLE  12.3s] line" (seconds since this
# script started), without the firmware's chatter.
show() {
  local line
  while IFS= read -r line; do
    case $line in
      "" | *iPXE* | *SeaBIOS* | *"Press Ctrl-B"* | "Booting from ROM"*) continue ;;
    esac
    printf '[%s %5.1fs] %s\n' "$1" "$(awk -v a="$t_start" -v b="$EPOCHREALTIME" \
      'BEGIN {print b - a}')" "$line"
  done
}

start_vm 1 server listen
# Host 2 connects, so host 1 must be listening on both ports first.
for ((i = 0; i < 100; i++)); do
  port_listening "$port0" && port_listening "$port1" && break
  sleep 0.1
done
if ! port_listening "$port0" || ! port_listening "$port1"; then
  echo "run-vm: host 1's QEMU is not listening on 127.0.0.1:$port0/$port1" >&2
  wait
  exit 1
fi
start_vm 2 client connect
wait
pids=()
t_end=$EPOCHREALTIME

status_of() {
  local log=$run/host$1.log line
  line=$(grep -a "^KVLINK-VM-EXIT host=$1 " "$log" | tail -n1)
  if [[ -n $line ]]; then
    echo "${line##*status=}"
  elif grep -aq "^run-vm: qemu exit 124" "$log" || grep -aq "^run-vm: qemu exit 137" "$log"; then
    echo 124
  else
    echo 1
  fi
}
s1=$(status_of 1)
s2=$(status_of 2)
ready() { grep -ao "host $1 ([a-z]*) ready, [0-9.]* s" "$run/host$1.log" | grep -o "[0-9.]* s" || echo "-"; }
echo "run-vm: host 1 status $s1 (ready $(ready 1) after boot), host 2 status $s2" \
  "(ready $(ready 2) after boot); total wall time $(awk -v a="$t_start" -v b="$t_end" \
  'BEGIN {printf "%.1f", b - a}') s; logs in $run"
((s1 == 124 || s2 == 124)) && echo "run-vm: TIMEOUT after ${timeout_s} s" >&2
rm -rf "$run/job" "$run/job.gz" "$run/initrd.gz"
if [[ $s1 != 0 ]]; then exit "$s1"; fi
exit "$s2"
