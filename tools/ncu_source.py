"""Where a kernel's warps stall, from Nsight Compute's source page (stall samples per SASS
instruction).

    ncu --clock-control none --section SourceCounters --section WarpStateStats \\
        -k regex:dkdv -s 2 -c 1 -o dkdv \\
        python tools/profile_kernel.py --backward --wgmma 8,3,ring,pingpong --dtype bfloat16
    ncu -i dkdv.ncu-rep --page source --csv --print-source sass > dkdv.csv
    python tools/ncu_source.py dkdv.csv [--top 40] [--ranges 0-1186 1186-1394 ...]

Prints the samples by stall reason, the instructions with the most samples (their index in the
listing, the SASS, the samples and their two main reasons) and, with --ranges, the share of
the samples in each range [a, b) of instruction indices: how docs/performance.md splits a
loop into stretches (the indices are those of one build's listing: read them off --top and
the listing itself).
"""

import argparse
import csv
import sys

ALL = "Warp Stall Sampling (All Samples)"


def read(path):
    """The listing's instructions in order, each (sass, samples, {stall reason: samples})."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if ALL in row)
    header = rows[header_at]
    total = header.index(ALL)
    reasons = [
        (i, name[len("stall_") :])
        for i, name in enumerate(header)
        if name.startswith("stall_") and "Not Issued" not in name
    ]
    out = []
    for row in rows[header_at + 1 :]:
        if len(row) <= total or not row[total].strip().isdigit():
            continue
        stalls = {name: int(row[i] or 0) for i, name in reasons}
        out.append((row[1].strip(), int(row[total]), stalls))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    ap.add_argument("--top", type=int, default=30, help="instructions listed")
    ap.add_argument("--ranges", nargs="*", default=[], help="a-b: instruction indices [a, b)")
    args = ap.parse_args(argv)
    listing = read(args.csv)
    total = sum(samples for _, samples, _ in listing) or 1
    by_reason = {}
    for _, _, stalls in listing:
        for name, n in stalls.items():
            by_reason[name] = by_reason.get(name, 0) + n
    print(f"{len(listing)} instructions, {total} samples")
    print(
        "by reason: "
        + ", ".join(
            f"{name} {100 * n / total:.1f}%"
            for name, n in sorted(by_reason.items(), key=lambda kv: -kv[1])
            if n
        )
    )
    top = sorted(range(len(listing)), key=lambda i: -listing[i][1])[: args.top]
    for i in sorted(top):
        sass, samples, stalls = listing[i]
        main_reasons = sorted(stalls.items(), key=lambda kv: -kv[1])[:2]
        reasons = ", ".join(f"{name} {n}" for name, n in main_reasons if n)
        print(f"{i:6d}  {sass[:60]:60s} {samples:7d} {100 * samples / total:5.1f}%  {reasons}")
    for text in args.ranges:
        a, b = (int(x) for x in text.split("-"))
        n = sum(samples for _, samples, _ in listing[a:b])
        first = listing[a][0][:40] if a < len(listing) else ""
        print(f"[{a}, {b}) {100 * n / total:5.1f}%  from {first}")


if __name__ == "__main__":
    sys.exit(main())
