#!/usr/bin/env bash
# The RDMA tests between two hosts (ctest: rdma.vm). Builds the soft-RoCE VM
# image with the test binary (build-vm.sh: Debian packages, the kernel via
# apt-get download, busybox, rdma-core), boots two VMs with two rails each
# (run-vm.sh) and runs kvlink_rdma_vm_test as server on host 1 and client on
# host 2. The server ends by being killed on purpose (scenario 5), which is
# its expected status. Then host 2 runs the conformance suite over RDMA
# (kvlink_conformance_rdma: two engines in one process over rxe).
#
# Usage: run-rdma-tests.sh PATH/TO/kvlink_rdma_vm_test PATH/TO/kvlink_conformance_rdma
# Exit status: the tests' (0 = all passed); 77 = skipped (no QEMU, no VM
# image could be built) unless KVLINK_REQUIRE_VM=1, where that is a failure.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${1:?usage: run-rdma-tests.sh PATH/TO/kvlink_rdma_vm_test PATH/TO/kvlink_conformance_rdma}
conformance=${2:?usage: run-rdma-tests.sh PATH/TO/kvlink_rdma_vm_test PATH/TO/kvlink_conformance_rdma}

skip() {
  if [[ ${KVLINK_REQUIRE_VM:-0} == 1 ]]; then
    echo "FAILED: $* (KVLINK_REQUIRE_VM=1: the VM tests must run here)"
    exit 1
  fi
  echo "SKIPPED: $*"
  exit 77
}

command -v qemu-system-x86_64 >/dev/null || [[ $(id -u) == 0 ]] ||
  skip "qemu-system-x86_64 not installed and not root to install it"
if ! "$here/build-vm.sh" "$bin" "$conformance"; then
  skip "could not build the VM image (see build-vm output above)"
fi

# shellcheck disable=SC2016
"$here/run-vm.sh" --timeout 420 --smp 2 -- '
  if [ "$KVLINK_ROLE" = server ]; then
    kvlink_rdma_vm_test server; s=$?
    # Scenario 5 kills the server with SIGKILL: 137 is its expected end.
    [ $s -eq 137 ] && s=0
    exit $s
  fi
  kvlink_rdma_vm_test client; c=$?
  KVLINK_QUIET=1 kvlink_conformance_rdma; k=$?
  echo "client: scenarios status $c, conformance status $k"
  [ $c -eq 0 ] && [ $k -eq 0 ]'
status=$?
if [[ $status == 77 ]]; then skip "run-vm.sh could not run a VM"; fi
exit $status
