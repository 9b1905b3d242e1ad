#!/bin/sh
# ib_write_bw between the two VM hosts: over rail 0 (rxe0), over rail 1
# (rxe1), then over both at once. Run on both hosts by run-vm.sh; the role
# decides which side serves. Usage: ib-write-bw-rails.sh [SIZE_BYTES] [ITERS]
size=${1:-1048576}
iters=${2:-20}
set -u

# bw RAIL PORT [PEER]: one ib_write_bw on rxeRAIL, server without PEER.
bw() {
  dev=rxe$1
  gid=$(roce-v2-gid "$dev") || { echo "no RoCE v2 IPv4 GID on $dev"; return 1; }
  if [ $# -lt 3 ]; then
    ib_write_bw -d "$dev" -x "$gid" -p "$2" -s "$size" -n "$iters" -F --report_gbits
    return
  fi
  # The server may not listen yet: retry the connection for a while.
  i=0
  while :; do
    ib_write_bw -d "$dev" -x "$gid" -p "$2" -s "$size" -n "$iters" -F --report_gbits "$3" && return 0
    i=$((i + 1))
    [ $i -lt 20 ] || return 1
    sleep 0.5
  done
}

peer0= peer1=
if [ "$KVLINK_ROLE" = client ]; then peer0=$KVLINK_PEER0 peer1=$KVLINK_PEER1; sleep 1; fi
st=0
echo "=== rail 0 (rxe0, 10.77.1.0/24) ==="
bw 0 18515 $peer0 || st=1
[ "$KVLINK_ROLE" = client ] && sleep 1
echo "=== rail 1 (rxe1, 10.77.2.0/24) ==="
bw 1 18516 $peer1 || st=1
[ "$KVLINK_ROLE" = client ] && sleep 1
echo "=== both rails at once ==="
bw 0 18517 $peer0 >/tmp/both0 2>&1 &
p0=$!
bw 1 18518 $peer1 >/tmp/both1 2>&1 &
p1=$!
wait $p0 || st=1
wait $p1 || st=1
sed 's/^/rail0: /' /tmp/both0
sed 's/^/rail1: /' /tmp/both1
exit $st
