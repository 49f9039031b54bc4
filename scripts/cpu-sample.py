#!/usr/bin/env python3
"""Where a run's CPU goes, by process: ``scripts/cpu-sample.py STOPFILE`` samples every process's CPU time
(utime + stime, from /proc) every half second until STOPFILE exists, then writes STOPFILE.json: each process's
name and command line (cut to 160 characters) with the CPU seconds it used while sampled, most first.

Used for docs/performance.md's split of the suite's CPU between its own processes (xdist workers, rank zygotes and
their workers) and the machine's (kernel threads, the sandbox's server). A process that ends between two samples
loses at most its last half second, so the figures are a floor; a process already running when sampling begins
counts only what it uses from then on.

    scripts/cpu-sample.py /tmp/stop & CI=true bash .ci/run; touch /tmp/stop
"""

import collections
import json
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def label(pid: int) -> str | None:
    try:
        argv = [a.decode(errors="replace") for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if a]
        return open(f"/proc/{pid}/comm").read().strip() + " | " + " ".join(argv)[:160]
    except OSError:
        return None  # gone already


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / HZ  # utime, stime (fields 14 and 15 of stat(5))


def main(stop: str) -> None:
    seen: dict[int, list] = {}  # pid -> [label, CPU seconds at its last sample]
    used: collections.Counter = collections.Counter()
    first = True
    while not os.path.exists(stop):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            now = cpu_seconds(pid)
            if now is None:
                continue
            if pid not in seen:
                name = label(pid)
                if name is None:
                    continue
                # a process there before sampling began counts from now; one born since, from its start
                seen[pid] = [name, now if first else 0.0]
            name, last = seen[pid]
            if now > last:
                used[name] += now - last
                seen[pid][1] = now
        first = False
        time.sleep(0.5)
    with open(stop + ".json", "w") as out:
        json.dump(used.most_common(), out, indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
