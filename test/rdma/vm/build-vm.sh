#!/usr/bin/env bash
# Builds the soft-RoCE test VM: a Debian kernel and an initramfs holding
# busybox, iproute2's ip and rdma, libibverbs with the rxe provider, perftest
# and the kernel modules rdma_rxe needs, plus any programs given as arguments
# (each copied with the libraries ldd lists). See run-vm.sh for running it and
# ../shared/notes/rdma-vm.md for what was checked to work.
#
# Usage: build-vm.sh [PROGRAM...]
#   PROGRAM  an executable (ELF or script) to put in the VM's /usr/local/bin
#
# Idempotent: the Debian packages are installed only when missing, the kernel
# package is downloaded and unpacked once into the cache; the initramfs is
# rebuilt on every call (a few seconds) so that it holds the programs given.
#
# Cache: $KVLINK_VM_DIR, default <repo>/.vm (git-ignored). Produces
#   $KVLINK_VM_DIR/vmlinuz      the kernel
#   $KVLINK_VM_DIR/initrd.gz    the initramfs (cpio newc, gzip)
# Exit status: 0 built, 1 failed (with the reason on stderr).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
vm_dir=${KVLINK_VM_DIR:-$repo/.vm}
multiarch=x86_64-linux-gnu

die() { echo "build-vm: $*" >&2; exit 1; }
log() { echo "build-vm: $*" >&2; }

for p in "$@"; do
  [[ -f $p && -x $p ]] || die "not an executable file: $p"
done

# --- 1. Debian packages ------------------------------------------------------
packages=(qemu-system-x86 busybox-static rdma-core ibverbs-providers ibverbs-utils perftest
          iproute2 cpio)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$pkg")
done
if ((${#missing[@]})); then
  [[ $(id -u) == 0 ]] || die "missing packages (${missing[*]}); run as root or apt-get install them"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. Kernel -----------------------------------------------------------------
mkdir -p "$vm_dir/deb"
kernel_package() {
  apt-cache depends linux-image-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}
kpkg=$(kernel_package)
if [[ -z $kpkg && $(id -u) == 0 ]]; then
  # A fresh image may have no package lists yet.
  apt-get update -qq && kpkg=$(kernel_package)
fi
[[ -n $kpkg ]] || die "apt-cache depends linux-image-amd64 names no kernel image package"
kroot=$vm_dir/kernel/$kpkg
if [[ ! -f $kroot/.unpacked ]]; then
  deb=$(ls "$vm_dir/deb/${kpkg}"_*.deb 2>/dev/null | head -n1 || true)
  if [[ -z $deb ]]; then
    log "downloading $kpkg"
    # apt-get download writes into the current directory.
    (cd "$vm_dir/deb" && apt-get download -qq "$kpkg") || die "apt-get download $kpkg failed"
    deb=$(ls "$vm_dir/deb/${kpkg}"_*.deb | head -n1)
  fi
  log "unpacking $(basename "$deb")"
  rm -rf "$kroot"
  mkdir -p "$kroot"
  dpkg-deb -x "$deb" "$kroot"
  touch "$kroot/.unpacked"
fi
vmlinuz=$(ls "$kroot"/boot/vmlinuz-* | head -n1)
kver=${vmlinuz##*/vmlinuz-}
moddir=$kroot/lib/modules/$kver/kernel
[[ -d $moddir ]] || die "no modules in $kroot for $kver"
cp -f "$vmlinuz" "$vm_dir/vmlinuz"

# Load order matters: rdma_rxe fails to add a link ("rdma_rxe: failed to add")
# without crc32_generic; the tunnels and ib_core are its dependencies; e1000
# drives the emulated NICs.
modules=(crypto/crc32_generic net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel
         drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs
         drivers/infiniband/sw/rxe/rdma_rxe drivers/net/ethernet/intel/e1000/e1000)

# --- 3. Initramfs --------------------------------------------------------------
stage=$(mktemp -d "$vm_dir/initramfs.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,usr/local/bin,etc/libibverbs.d,proc,sys,dev,tmp,run}
mkdir -p "$stage"/{lib/modules,lib64,root,job}

# busybox as /bin/*; iproute2's ip replaces busybox's (which cannot do all we need).
cp /bin/busybox "$stage/bin/busybox"
for applet in $("$stage/bin/busybox" --list); do
  [[ -e $stage/bin/$applet ]] || ln -s busybox "$stage/bin/$applet"
done

# Copies a file to the same path in the image, with the libraries it needs.
copy_with_libs() {
  local src=$1 dst=${2:-$1}
  mkdir -p "$stage$(dirname "$dst")"
  cp -L "$src" "$stage$dst"
  if [[ $(head -c4 "$src" | tail -c3) == ELF ]]; then
    local lib
    for lib in $(ldd "$src" 2>/dev/null | grep -o '/[^ ]*' | sort -u); do
      [[ -e $stage$lib ]] && continue
      mkdir -p "$stage$(dirname "$lib")"
      cp -L "$lib" "$stage$lib"
    done
  fi
}

ip_bin=
for c in /usr/bin/ip /bin/ip /sbin/ip /usr/sbin/ip; do
  if [[ -x $c && $(readlink -f "$c") != */busybox ]]; then ip_bin=$c; break; fi
done
[[ -n $ip_bin ]] || die "iproute2's ip not found"
rm -f "$stage/bin/ip" "$stage/sbin/ip"
copy_with_libs "$ip_bin" /usr/bin/ip
copy_with_libs "$(command -v rdma)" /usr/bin/rdma
for tool in ib_write_bw ib_read_bw ibv_devinfo ibv_devices; do
  copy_with_libs "$(command -v "$tool")" "/usr/bin/$tool"
done
# The rxe provider is loaded by libibverbs at run time (dlopen), so ldd of
# the programs does not list it.
rxe_lib=/usr/lib/$multiarch/libibverbs/librxe-rdmav34.so
[[ -f $rxe_lib ]] || rxe_lib=$(ls /usr/lib/$multiarch/libibverbs/librxe-rdmav*.so | head -n1)
copy_with_libs "$rxe_lib"
cp /etc/libibverbs.d/rxe.driver "$stage/etc/libibverbs.d/"

for p in "$@"; do
  copy_with_libs "$(readlink -f "$p")" "/usr/local/bin/$(basename "$p")"
done

# Kernel modules, uncompressed (busybox insmod reads plain .ko files).
: >"$stage/etc/kvlink-modules"
for m in "${modules[@]}"; do
  f=$(ls "$moddir/$m".ko* 2>/dev/null | head -n1 || true)
  [[ -n $f ]] || die "module $m not found in $moddir"
  case $f in
    *.ko.xz) xz -dc "$f" >"$stage/lib/modules/${m##*/}.ko" ;;
    *.ko.zst) zstd -qdc "$f" >"$stage/lib/modules/${m##*/}.ko" ;;
    *.ko.gz) gzip -dc "$f" >"$stage/lib/modules/${m##*/}.ko" ;;
    *) cp "$f" "$stage/lib/modules/${m##*/}.ko" ;;
  esac
  echo "${m##*/}.ko" >>"$stage/etc/kvlink-modules"
done

# roce-v2-gid DEV [PORT]: the index of DEV's RoCE v2 IPv4-mapped GID (for
# perftest's -x; kvlink finds it by itself).
cat >"$stage/usr/local/bin/roce-v2-gid" <<'EOF'
#!/bin/sh
d=/sys/class/infiniband/$1/ports/${2:-1}
for f in "$d"/gid_attrs/types/*; do
  i=${f##*/}
  t=$(cat "$f" 2>/dev/null) || continue
  g=$(cat "$d/gids/$i" 2>/dev/null) || continue
  case "$t|$g" in
    "RoCE v2|0000:0000:0000:0000:0000:ffff:"*) echo "$i"; exit 0 ;;
  esac
done
exit 1
EOF
chmod +x "$stage/usr/local/bin/roce-v2-gid"

cp "$here/vm-init.sh" "$stage/init"
chmod +x "$stage/init"

(cd "$stage" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) >"$vm_dir/initrd.gz.tmp"
mv "$vm_dir/initrd.gz.tmp" "$vm_dir/initrd.gz"
log "kernel $kver, initramfs $(du -h "$vm_dir/initrd.gz" | cut -f1)B in $vm_dir"
