#!/usr/bin/env bash
# Runs one kvlink libFuzzer target for a bounded time on a copy of its seeds.
#
#   test/fuzz/run-fuzz.sh BINARY CORPUS_DIR [SECONDS]
#
# SECONDS: the third argument, else $KVLINK_FUZZ_SECONDS, else 45. Any further
# arguments go to libFuzzer as they are (e.g. -jobs=2, -dict=FILE).
#
# Nothing is written into CORPUS_DIR (the repository's seeds): the seeds are
# copied to a temporary work folder, libFuzzer writes what it finds to
# WORK/corpus and any crash, timeout or out-of-memory input to WORK/ as
# crash-*, timeout-*, oom-* (-artifact_prefix). Prints the final execution and
# coverage figures; exits 1 when libFuzzer found something, printing
# the end of its log and the path of every crash input, and then keeps the
# work folder (removed otherwise, unless KVLINK_FUZZ_KEEP=1). Reproduce a
# crash with `BINARY CRASH_FILE`.
set -u

if [ $# -lt 2 ]; then
  echo "usage: $0 BINARY CORPUS_DIR [SECONDS] [libFuzzer args...]" >&2
  exit 2
fi
binary=$1
seeds=$2
shift 2
seconds=${KVLINK_FUZZ_SECONDS:-45}
if [ $# -gt 0 ]; then
  seconds=$1
  shift
fi
case $seconds in
  '' | *[!0-9]*)
    echo "run-fuzz.sh: SECONDS must be a whole number, not '$seconds'" >&2
    exit 2
    ;;
esac
if [ ! -x "$binary" ]; then
  echo "run-fuzz.sh: $binary is not an executable (build it first)" >&2
  exit 2
fi
if [ ! -d "$seeds" ]; then
  echo "run-fuzz.sh: no seed corpus at $seeds" >&2
  exit 2
fi

name=$(basename "$binary")
work=$(mktemp -d "${TMPDIR:-/tmp}/${name}.XXXXXX") || exit 2
mkdir -p "$work/seeds" "$work/corpus"
cp -R "$seeds"/. "$work/seeds/"
log=$work/fuzz.log

echo "run-fuzz.sh: $name for ${seconds}s, $(find "$work/seeds" -type f | wc -l) seeds from $seeds"
echo "run-fuzz.sh: work folder $work"
"$binary" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
  -artifact_prefix="$work/" -print_final_stats=1 "$@" \
  "$work/corpus" "$work/seeds" >"$log" 2>&1
rc=$?

# The last status line (#N DONE ... cov: ft: corp: exec/s: rss:) and the totals.
grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED|RELOAD)' "$log" | tail -n 1
grep -E '^(Done [0-9]+ runs|stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added|stat::peak_rss_mb)' "$log"
echo "run-fuzz.sh: corpus now $(find "$work/corpus" -type f | wc -l) new inputs + $(find "$work/seeds" -type f | wc -l) seeds"

artifacts=$(find "$work" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' -o -name 'slow-unit-*' \) | sort)
if [ "$rc" -ne 0 ] || printf '%s\n' "$artifacts" | grep -q -E '/(crash|timeout|oom|leak)-'; then
  echo "run-fuzz.sh: $name FAILED (libFuzzer exit $rc); the end of $log:"
  tail -n 80 "$log"
  for a in $artifacts; do
    echo "run-fuzz.sh: input kept at $a (reproduce: $binary $a)"
  done
  exit 1  # not libFuzzer's code as it is: its 77 would read as "skipped" to some runners
fi
if [ "${KVLINK_FUZZ_KEEP:-0}" = 1 ]; then
  echo "run-fuzz.sh: kept $work"
else
  rm -rf "$work"
fi
echo "run-fuzz.sh: $name passed"
exit 0
