"""Prints each size of a comma-separated list in bytes, one per line, for the
bench scripts (bench/compare, bench/compare_same_host): a whole number with an
optional unit, B, KiB, MiB, GiB (2^10..2^30) or KB, MB, GB (10^3..10^9).

    python3 bench/sizes.py 4KiB,64KiB,1MiB
"""

import re
import sys

UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
         "KB": 10**3, "MB": 10**6, "GB": 10**9}

for s in sys.argv[1].split(","):
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).upper() not in UNITS:
        sys.exit(f"bad size '{s}' (a whole number of bytes, optionally B, KiB, MiB, GiB, KB, MB, GB)")
    print(int(m.group(1)) * UNITS[m.group(2).upper()])
