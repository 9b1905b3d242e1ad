#!/usr/bin/env python3
"""Plots `kvlink-bench kv --csv` output: bandwidth (GB/s = 10^9 B/s, with the
min..max spread of the runs) and share of the line rate vs prompt length
(same-host rows, `--transport shm`: share of a memcpy of the same pieces).

    kvlink-bench kv --csv > kv.csv
    python3 bench/plot.py kv.csv out/kvlink_kv      # writes out/kvlink_kv.png and .svg

Needs matplotlib (Debian: python3-matplotlib). Rows with an error are skipped.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: plot.py KV_CSV OUTPUT_PREFIX")
    rows = [r for r in csv.DictReader(open(argv[1])) if not r["error"]]
    if not rows:
        sys.exit(f"plot.py: no usable rows in {argv[1]}")
    tokens = [int(r["prompt_tokens"]) for r in rows]
    bytes_ = [int(r["bytes"]) for r in rows]
    gbps = [float(r["gb_per_s"]) for r in rows]
    # Bandwidth at the slowest and fastest run: the spread as error bars.
    lo = [b / (float(r["max_ms"]) / 1e3) / 1e9 for b, r in zip(bytes_, rows)]
    hi = [b / (float(r["min_ms"]) / 1e3) / 1e9 for b, r in zip(bytes_, rows)]
    line = float(rows[0]["line_rate_gb_per_s"]) if rows[0]["line_rate_gb_per_s"] else None
    first = rows[0]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.errorbar(tokens, gbps, yerr=[[g - a for g, a in zip(gbps, lo)],
                                     [b - g for g, b in zip(gbps, hi)]],
                 marker="o", capsize=3, label="kvlink (median, min..max)")
    if line:
        ax1.axhline(line, color="grey", linestyle="--", label=f"line rate {line:.2f} GB/s")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("prompt length (tokens)")
    ax1.set_ylabel("bandwidth (GB/s, 10^9 B/s)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("KV transfer bandwidth")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)

    # Same-host rows: their reference is a memcpy of their own pieces.
    by_memcpy = all(r.get("memcpy_share_pct") for r in rows)
    if by_memcpy or line:
        column = "memcpy_share_pct" if by_memcpy else "line_rate_share_pct"
        share = [float(r[column]) for r in rows]
        ax2.plot(tokens, share, marker="o", color="tab:green")
        ax2.set_ylim(0, max(110.0, max(share) * 1.05))
        ax2.set_title("share of a memcpy of the same pieces" if by_memcpy else "share of line rate")
    else:
        ax2.text(0.5, 0.5, "no line rate in this run", ha="center", va="center",
                 transform=ax2.transAxes)
        ax2.set_title("share of line rate (unavailable)")
    ax2.set_xscale("log", base=2)
    labels = [f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in tokens]
    for ax in (ax1, ax2):
        ax.set_xticks(tokens)
        ax.set_xticklabels(labels)
        ax.minorticks_off()
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("% of memcpy" if by_memcpy else "% of line rate")
    ax2.grid(True, alpha=0.3)

    fig.suptitle(f"kvlink-bench kv: {first['op']}, {first['block_ids']} block ids, "
                 f"{first['lanes']} lanes", fontsize=10)
    fig.tight_layout()
    for ext in ("png", "svg"):
        path = f"{argv[2]}.{ext}"
        fig.savefig(path, dpi=120)
        print(f"# plot: {path}")


if __name__ == "__main__":
    main(sys.argv)
