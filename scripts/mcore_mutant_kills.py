"""How many of MCore's sharded cases kill each of two planted bugs (tests/impls/broken_mcore.py), on gloo.

`vdpcp mutants` stops at a mutant's first kill; this counts every case that kills it (a bug worth planting should be
killed by most sharded cases, not 2-8): on gloo those bugs show only where gradients are judged.

    ./run python scripts/mcore_mutant_kills.py [--cp 2 4] [--json PATH]
"""

import argparse
import json
import sys
from collections import Counter

SUBJECTS = ("tests.impls.broken_mcore:gather_before_project", "tests.impls.broken_mcore:skips_tower")


def changes_something(subject: str, case) -> bool:
    """Whether the planted bug changes anything in ``case``: the projector's place, wherever images are encoded; the
    skipped tower, where some rank holds only placeholders (vdpcp's count plan, parity-tested against MCore's)."""
    from dataclasses import replace

    from vdpcp.feature.sharded import plan_for

    if not case.spec.images:
        return False
    if subject.endswith("skips_tower"):
        plan = plan_for(case.spec, replace(case.config, strategy="count"))
        return any(shard.num_real_rows == 0 for shard in plan.shards)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", help="write each case's verdict per subject")
    args = parser.parse_args(argv)

    from vdpcp.harness.config import configure
    from vdpcp.matrix import scenarios
    from vdpcp.matrix.runner import preload_case_modules, run_judged

    configure(backend="gloo")
    preload_case_modules(["mcore", *SUBJECTS])
    sharded = [case for case in scenarios.matrix(cps=tuple(args.cp), impls=("mcore",))
               if case.cp > 1 and case.config.shard_vision and case.config_cp is None]
    record = {}
    for subject in SUBJECTS:
        verdicts = {}
        for case in sharded:
            judged = run_judged(case.with_(impl=subject))
            verdicts[case.id] = judged.verdict
        killed = [i for i, v in verdicts.items() if v not in ("pass", "xfail", "replicated", "resource")]
        changed = [case.id for case in sharded if changes_something(subject, case)]
        print(f"{subject}: killed by {len(killed)} of the {len(changed)} sharded cases it changes something in "
              f"({len(sharded)} sharded cases); verdicts {dict(Counter(verdicts.values()))}")
        print(f"  not killed by, of those: {', '.join(i for i in changed if i not in killed) or '-'}")
        record[subject] = verdicts
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
