"""Run the correctness matrix (vdpcp.scenarios) at one dtype on this machine and print a markdown check table.

Made for the one-GPU machine, where the pytest matrix runs at float64 only: this reruns the same cases at
another dtype (bf16 on CUDA), judged the same way (vdpcp.runner.run_judged: known upstream limits are expected
failures), with the errors the case measured. Usage, from the repository root:

    VDPCP_DEVICE=cuda python reports/h200/check_table.py --backend gloo --dtype bfloat16 > table.md
"""

import argparse
import collections
import sys
import time

from vdpcp import scenarios
from vdpcp.expectations import PASSING, expects_group_error, known_limit
from vdpcp.harness.config import resolve_backend
from vdpcp.runner import run_judged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32", "bfloat16"))
    parser.add_argument("--backend", default=None, choices=("auto", "nccl", "gloo"))
    parser.add_argument("--cp", type=int, action="append", help="only these CP sizes (repeatable)")
    parser.add_argument("--skip-known-limits", action="store_true",
                        help="leave out cases a known upstream limit fails on this backend (listed at the end)")
    args = parser.parse_args()
    cases = [
        case.with_(dtype=args.dtype)
        for case in scenarios.matrix()
        if not expects_group_error(case) and (not args.cp or case.cp in args.cp)
    ]
    skipped = []
    if args.skip_known_limits:
        skipped = [c for c in cases if known_limit(c, resolve_backend(args.backend, c.world_size))]
        cases = [c for c in cases if c not in skipped]
    print("| case | backend | verdict | max out err | max input-grad err | max param-grad err | s | why |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    verdicts = collections.Counter()
    start = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        judged = run_judged(case, backend=args.backend)
        result, verdict, why, backend = judged.result, judged.verdict, judged.why, judged.result.backend
        verdicts[verdict] += 1
        errs = [f"{result.max_err(a):.2e}" for a in ("out_err", "input_grad_err", "param_grad_err")]
        why = (why or "; ".join(result.failures)).replace("|", "/").replace("\n", " ")[:300]
        print(f"| {case.id} | {backend} | {verdict} | {' | '.join(errs)} | {time.perf_counter() - t0:.2f} | {why} |", flush=True)
    total = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
    print(f"\n{len(cases)} cases at {args.dtype} in {time.perf_counter() - start:.0f} s: {total}")
    if skipped:
        print(f"\nnot run ({len(skipped)}, known upstream limits on this backend): {', '.join(c.id for c in skipped)}")
    return 0 if set(verdicts) <= set(PASSING) else 1


if __name__ == "__main__":
    sys.exit(main())
