#!/usr/bin/env python3
"""What a `vdpcp bench towers --json` record says about the real-size targets, by arithmetic on its figures
(no run): where the time went (each phase of rank 0, summed), what the cases whose ranks took turns for the
unsharded arm cost (vdpcp.oracle.arms._turns: a shared GPU without room for every rank's unsharded arm at once),
and what the CP 2 median and the whole selection would be if rank 0's unsharded phase were cut by a share, as
one unsharded arm per CP group would at most cut it (docs/performance.md, "The targets left").

    python3 scripts/real-size-projection.py reports/gpu/real-bfloat16-17524ab-h100.json

A projection, not a measurement: a phase shortened on one rank does not shorten the case where another rank is
slower, and on a GPU the ranks share, less work on one rank speeds the others.
"""

import collections
import json
import statistics
import sys
from pathlib import Path


def main(path: str) -> None:
    record = json.loads(Path(path).read_text())
    cases = [c for c in record["cases"] if c.get("ranks")]
    phases = collections.Counter()
    for case in cases:
        phases.update(case["ranks"][0]["seconds"])
    print(f"{path}: {len(record['cases'])} cases, {record['wall_s']} s wall, {len(cases)} ran")
    print("rank 0's phases summed: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.most_common()))
    turns = [c for c in cases if any(rank.get("turns") for rank in c["ranks"])]
    print(f"cases whose ranks took turns: {len(turns)}, {sum(c['seconds'] for c in turns):.1f} s "
          f"(of {sum(c['seconds'] for c in cases):.1f} s in cases)")
    for cut in (0.0, 0.5, 0.75):
        cp2 = [_cut(c, cut) for c in cases if c["cp"] == 2 and c["world"] == 2]
        cp4 = [_cut(c, cut) for c in cases if c["cp"] == 4 and c["world"] == 4]
        whole = sum(_cut(c, cut) for c in cases)
        print(f"rank 0's unsharded phase cut by {cut:.0%}: median "
              f"{statistics.median(cp2):.2f} s at CP 2 over {len(cp2)}, {statistics.median(cp4):.2f} s at CP 4 over "
              f"{len(cp4)}, the cases {whole:.1f} s")


def _cut(case: dict, share: float) -> float:
    return case["seconds"] - share * case["ranks"][0]["seconds"]["unsharded"]


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["reports/gpu/real-bfloat16-17524ab-h100.json"]:
        main(arg)
