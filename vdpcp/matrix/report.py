"""Reports of `vdpcp check` and `vdpcp mutants`: a table for the terminal, JSON, and JUnit XML for CI.

A check row is one case's judged result (vdpcp.matrix.expectations.judge): pass, replicated (encoded whole on every rank,
as the implementation's fallback policy says), fail, plan-mismatch, grad-written, not-sharded, unbalanced, error,
unsharded-error, resource, xfail (a known upstream
limit failed the known way) or xpass (a strict xfail passed). A mutant row is one vdpcp.tools.mutants.hunt.Hunt. Both become
the same JUnit shape: pass and replicated pass, xfail (and a mutant that does not apply) is a skipped test with its
reason, error an error, anything else a failure whose message starts with its verdict (a property says it too).
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vdpcp.feature.spec import spec_record
from vdpcp.matrix.progress import write_atomically
from vdpcp.usage import UsageError

STYLES = {"pass": "green", "replicated": "green", "xfail": "yellow", "killed": "green", "n/a": "yellow",
          "fail": "bold red", "error": "bold red", "xpass": "bold red", "survived": "bold red",
          "unsharded-error": "bold red", "plan-mismatch": "bold red", "grad-written": "bold red",
          "not-sharded": "bold magenta", "unbalanced": "magenta", "resource": "bold red"}
ERRORS = (("out_err", "outputs"), ("input_grad_err", "input grads"), ("param_grad_err", "param grads"))


@dataclass
class CheckRow:
    family: str
    verdict: str  # as vdpcp.matrix.expectations.judge says
    why: str
    result: object  # vdpcp.matrix.runner.CaseResult
    seconds: float
    output: str = ""  # what the ranks printed, kept for cases that did not pass

    @property
    def case(self):
        return self.result.case


@dataclass
class MutantRow:
    hunt: object  # vdpcp.tools.mutants.hunt.Hunt
    bug: str
    seconds: float

    @property
    def verdict(self) -> str:
        return "killed" if self.hunt.killed else "n/a" if self.hunt.not_applicable else "survived"


LOG_WIDTH = 1000  # wider than any table: at 200 a CP-8 check table squeezed its `why` column to a word a line


def console() -> Console:
    """stdout; off a terminal (a CI log) wider than any table, so each row stays one line and no cell wraps."""
    return Console(width=None if sys.stdout.isatty() else LOG_WIDTH, highlight=False)


# --- check ---------------------------------------------------------------------------------------------


def check_table(rows: list[CheckRow], backend: str) -> Table:
    table = Table(title=f"vdpcp check ({backend})", show_lines=False)
    for name in ("family", "case", "CP", "impl", "split", "ran on", "images/rank", "patches/rank", "out err",
                 "in-grad err", "param err", "verdict"):
        table.add_column(name, justify="right" if name == "CP" or name.endswith("err") else "left", no_wrap=True)
    table.add_column("why", overflow="fold", max_width=60)
    for row in rows:
        case, result = row.case, row.result
        shown = ("the documented", "gradients not checked", "note:")
        why = "" if row.verdict == "pass" and not row.why.startswith(shown) else row.why
        table.add_row(row.family, _case_label(case), str(case.cp), case.impl, case.split, _ran_on(result), *_per_rank(result),
                      *(_err(result, attr) for attr, _ in ERRORS), f"[{STYLES.get(row.verdict, '')}]{row.verdict}[/]",
                      _short(why or ("" if row.verdict == "pass" else _first_failure(result)), 60))
    return table


def check_summary(rows: list[CheckRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.verdict] = counts.get(row.verdict, 0) + 1
    parts = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{len(rows)} cases: {parts}; {sum(r.seconds for r in rows):.1f} s in cases"


def check_record(row: CheckRow) -> dict:
    case, result = row.case, row.result
    return {
        "id": case.id,
        "family": row.family,
        "spec": spec_record(case.spec),
        "cp": case.cp,
        "impl": case.impl,
        "split": case.split,
        "dp": case.dp,
        "tp": case.tp,
        "loss": case.loss,
        "grads": case.grads,
        "vision_dp_over_cp": case.vision_dp_over_cp,
        "config_cp": case.config_cp,
        "backend": result.backend,
        "device": result.device,
        "collectives": result.collectives,
        "verdict": row.verdict,
        "why": row.why,
        "seconds": round(row.seconds, 3),
        "ranks": [_rank_record(r) for r in result.ranks],
        "failures": result.failures,
        **({"notes": result.notes} if result.notes else {}),
        **({"output": row.output} if row.output else {}),
    }


def _rank_record(r) -> dict:
    """One rank's part of a check record: its telemetry's figures, then its failures (and notes, where it has any)."""
    t = r.telemetry
    return {"rank": r.rank, "cp_rank": r.cp_rank, "backend": t.backend, "device": t.device,
            "collectives": t.collectives, "encoded": t.encoded,
            "images": t.images, "placeholders": t.placeholders, "patches": t.patches,
            "deterministic": t.deterministic, "exact": t.exact,
            **{attr: _finite(getattr(t, attr)) for attr, _ in ERRORS}, "unchecked_grads": r.unchecked_grads,
            "failures": list(r.failures), **({"notes": list(r.notes)} if r.notes else {})}


def check_junit(row: CheckRow) -> dict:
    junit = _junit_case(row.case.id, f"vdpcp.check.{row.family}", row.seconds, row.verdict,
                        row.why or _first_failure(row.result), row.result.summary())
    junit["properties"] = {"backend": row.result.backend, "device": row.result.device, "verdict": row.verdict,
                           **({"collectives": row.result.collectives} if row.result.collectives else {})}
    return junit


# --- mutants -------------------------------------------------------------------------------------------


def mutants_table(rows: list[MutantRow], backend: str) -> Table:
    table = Table(title=f"vdpcp mutants ({backend})")
    for name in ("mutant", "bug", "killed by", "how", "tried", "s"):
        table.add_column(name, no_wrap=name in ("mutant", "killed by"), justify="right" if name in ("tried", "s") else "left")
    for row in rows:
        h = row.hunt
        killer = f"[{STYLES[row.verdict]}]{h.killed_by or ('n/a' if h.not_applicable else 'SURVIVED')}[/]"
        table.add_row(h.mutant, row.bug, killer, _short(h.verdict or h.not_applicable or "", 90), str(len(h.tried or [])),
                      f"{row.seconds:.1f}")
    return table


def mutant_record(row: MutantRow) -> dict:
    h = row.hunt
    return {"mutant": h.mutant, "bug": row.bug, "verdict": row.verdict, "killed_by": h.killed_by,
            "how": h.verdict or h.not_applicable or "",
            "tried": h.tried, "seconds": round(row.seconds, 3)}


def mutant_junit(row: MutantRow) -> dict:
    h = row.hunt
    verdict = "pass" if h.killed else "xfail" if h.not_applicable else "fail"
    message = (f"killed by {h.killed_by}: {h.verdict}" if h.killed else h.not_applicable if h.not_applicable
               else f"survived {len(h.tried or [])} cases")
    return _junit_case(h.mutant, "vdpcp.tools.mutants", row.seconds, verdict, message, row.bug)


# --- writing -------------------------------------------------------------------------------------------


def write_json(path: Path, kind: str, records: list[dict], **meta) -> None:
    _write(path, json.dumps({"kind": kind, **meta, "results": records}, indent=1) + "\n")


def write_junit(path: Path, suite: str, cases: list[dict]) -> None:
    """JUnit XML as CI systems read it: one testsuite, one testcase per row."""
    root = ET.Element("testsuite", name=suite, tests=str(len(cases)),
                      failures=str(sum(c["outcome"] == "failure" for c in cases)),
                      errors=str(sum(c["outcome"] == "error" for c in cases)),
                      skipped=str(sum(c["outcome"] == "skipped" for c in cases)),
                      time=f"{sum(c['seconds'] for c in cases):.3f}")
    for c in cases:
        element = ET.SubElement(root, "testcase", classname=c["classname"], name=c["name"], time=f"{c['seconds']:.3f}")
        if c.get("properties"):
            properties = ET.SubElement(element, "properties")
            for key, value in c["properties"].items():
                ET.SubElement(properties, "property", name=key, value=str(value))
        if c["outcome"] != "passed":
            child = ET.SubElement(element, c["outcome"], message=c["message"])
            child.text = c["detail"]
    ET.indent(root)
    _write(path, ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n")


def _junit_case(name, classname, seconds, verdict, message, detail) -> dict:
    outcome = {"pass": "passed", "replicated": "passed", "xfail": "skipped", "error": "error",
               "resource": "error"}.get(verdict, "failure")
    return {"name": name, "classname": classname, "seconds": seconds, "outcome": outcome,
            "message": f"{verdict}: {message}" if message else verdict, "detail": detail}


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)  # rewritten after every case: never half a report
    except OSError as err:
        raise UsageError(f"{path}: cannot write the report ({err.strerror})") from None


def _case_label(case) -> str:
    parts = [case.spec.name] + [f"{axis}={n}" for axis, n in (("DP", case.dp), ("TP", case.tp)) if n > 1]
    if case.loss != "rank":
        parts.append(case.loss)
    if not case.grads:
        parts.append("outputs only")
    if getattr(case, "pixels", "tower") != "tower":
        parts.append(f"{case.pixels} pixels")
    if not case.vision_dp_over_cp:
        parts.append("opt-out")
    if case.config_cp is not None:
        parts.append(f"config CP={case.config_cp}")
    return " ".join(parts)


def _ran_on(result) -> str:
    """The backend and device the ranks reported (the resolved backend where they could not report)."""
    devices = sorted({r.device.split(":")[0] for r in result.ranks})
    return f"{result.backend}/{','.join(devices)}" if devices else (result.backend or "-")


def _per_rank(result) -> tuple[str, str]:
    """Real images (+ placeholders: "1p" is a rank of one placeholder) and patches of each rank: as the
    ranks reported them, or, where the case raised before they could, as its plan says."""
    case = result.case
    first = {}
    for r in result.ranks:  # one row per CP rank: the first replica's (every replica has the same shapes)
        first.setdefault(r.cp_rank, r)
    shares = [(r.images, r.placeholders, r.patches) for _, r in sorted(first.items())]
    if not shares and case.config.shard_vision and case.config.context_parallel_size == case.cp:
        from vdpcp.impls import resolve

        plan = resolve(case.impl).plan(case.spec, case.config)
        if plan is not None:
            shares = [(len(rows), plan.placeholders[r], sum(case.spec.row_patches[i] for i in rows))
                      for r, rows in enumerate(plan.rows_of(r) for r in range(case.cp))]
    if not shares:
        return "-", "-"
    images = " ".join((f"{n}+{p}p" if n else f"{p}p") if p else str(n) for n, p, _ in shares)
    return images, " ".join(str(patches) for _, _, patches in shares)


def _err(result, attr: str) -> str:
    measured = result.ranks and (attr == "out_err" or (result.case.grads and not result.unchecked_grads)) \
        and result.verdict not in ("unsharded-error", "resource")
    err = result.max_err(attr) if measured else math.nan
    return "-" if math.isnan(err) else f"{err:.1e}"  # NaN: not measured element by element (vdpcp.oracle.compare.sketch)


def _finite(value: float):
    return value if math.isfinite(value) else str(value)


def _first_failure(result) -> str:
    return ((result.failures or [""])[0].splitlines() or [""])[0]


def _short(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
