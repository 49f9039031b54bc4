"""Process helpers shared by the harness's tests."""

import os


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def described(pids) -> str:
    """What each of ``pids`` is, for a failure message: its name, state (Z: a zombie nobody reaped) and parent, from
    /proc. On a GPU machine a test that waits for processes to go failed once with no more than their pids."""
    lines = []
    for pid in pids:
        try:
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        except OSError:
            lines.append(f"{pid}: gone")
            continue
        lines.append(f"{pid}: {' '.join(status.get(k, '?').strip() for k in ('Name', 'State'))}, "
                     f"parent {status.get('PPid', '?').strip()}")
    return "; ".join(lines)
