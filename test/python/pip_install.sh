#!/usr/bin/env bash
# The README's pip steps, offline, as a user runs them: a venv that sees
# Debian's packages, kvlink and the opt-in mooncake alias installed with
# --no-build-isolation (nothing downloaded: --no-index), then
# `import mooncake.engine` gives kvlink's TransferEngine, outside the tree.
#
#   test/python/pip_install.sh SOURCE_DIR [PYTHON]     (PYTHON: /usr/bin/python3)
set -euo pipefail
src=$1
py=${2:-/usr/bin/python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvlink-pip.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$py" -m venv --system-site-packages "$work/venv"
# The module is built here with no build type (KVLINK_CMAKE_ARGS, setup.py's
# knob): pip's steps are what this checks, and the Release tree compiles the
# same module at -O3 (124 s of CI's 141 s here went to that compile).
KVLINK_CMAKE_ARGS=${KVLINK_CMAKE_ARGS--DCMAKE_BUILD_TYPE=} KVLINK_JOBS=${KVLINK_JOBS:-2} \
  "$work/venv/bin/pip" install -q --no-index --no-build-isolation \
  "$src" "$src/python/mooncake-alias"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import mooncake.engine as m
import kvlink
e = m.TransferEngine()
assert type(e).__module__ == "kvlink.mooncake", type(e).__module__
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert e.get_rpc_port() > 0
print("pip install: mooncake.engine ->", type(e).__module__, "from", kvlink.__file__)
PY
