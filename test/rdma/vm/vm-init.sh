#!/bin/sh
# /init of the soft-RoCE test VM (built into the initramfs by build-vm.sh).
#
# Reads kvlink.host=N (1 or 2) and kvlink.role=NAME from the kernel command
# line, loads the modules, brings up two rails (eth0 on 10.77.1.0/24, eth1 on
# 10.77.2.0/24, this host is .N on both) with rxe0 on eth0 and rxe1 on eth1,
# waits until the peer answers on both rails, then runs /job/cmd.sh (added by
# run-vm.sh) with
#   KVLINK_ROLE, KVLINK_HOST, KVLINK_SELF0/1, KVLINK_PEER0/1 (IPv4 per rail)
# in the environment, prints
#   KVLINK-VM-EXIT host=N role=NAME status=S
# and powers off. Set-up failures print the marker with status 125.
export PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /tmp /run
mount -t tmpfs tmpfs /tmp

host=0
role=none
for w in $(cat /proc/cmdline); do
  case $w in
    kvlink.host=*) host=${w#kvlink.host=} ;;
    kvlink.role=*) role=${w#kvlink.role=} ;;
  esac
done

finish() {
  echo "KVLINK-VM-EXIT host=$host role=$role status=$1"
  sync
  poweroff -f
  sleep 10
}

setup_fail() {
  echo "vm-init: $*" >&2
  dmesg | tail -n 20 >&2
  finish 125
}

for m in $(cat /etc/kvlink-modules); do
  insmod "/lib/modules/$m" || setup_fail "insmod $m failed"
done

case $host in
  1) peer=2 ;;
  2) peer=1 ;;
  *) setup_fail "kvlink.host=1|2 missing from the kernel command line" ;;
esac

ip link set lo up
for rail in 0 1; do
  net=$((rail + 1))
  ip addr add "10.77.$net.$host/24" dev "eth$rail" || setup_fail "no eth$rail"
  ip link set "eth$rail" up || setup_fail "eth$rail does not come up"
  rdma link add "rxe$rail" type rxe netdev "eth$rail" || setup_fail "rdma link add rxe$rail failed"
done

# Ports become ACTIVE and the IPv4 GID appears once the links are up.
i=0
until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null &&
      grep -q ACTIVE /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null &&
      roce-v2-gid rxe0 >/dev/null && roce-v2-gid rxe1 >/dev/null; do
  i=$((i + 1))
  [ $i -lt 100 ] || setup_fail "rxe ports not ACTIVE with a RoCE v2 IPv4 GID after 10 s"
  sleep 0.1
done

# Both hosts boot at the same time; this also waits for the other one.
for rail in 0 1; do
  net=$((rail + 1))
  i=0
  until ping -c 1 -W 1 "10.77.$net.$peer" >/dev/null 2>&1; do
    i=$((i + 1))
    [ $i -lt 60 ] || setup_fail "peer 10.77.$net.$peer not reachable on rail $rail"
  done
done

export KVLINK_ROLE=$role KVLINK_HOST=$host
export KVLINK_SELF0=10.77.1.$host KVLINK_SELF1=10.77.2.$host
export KVLINK_PEER0=10.77.1.$peer KVLINK_PEER1=10.77.2.$peer
echo "vm-init: host $host ($role) ready, $(cut -d' ' -f1 /proc/uptime) s after boot"
cd /root
if [ -f /job/cmd.sh ]; then
  sh /job/cmd.sh
  finish $?
fi
setup_fail "no /job/cmd.sh"
