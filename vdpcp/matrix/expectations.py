"""What a case is expected to do, and the one ``judge`` that every entry point uses to call its result.

Expectations are decided from the case's shape, its implementation and the backend it ran on, never from a
previous run:
- pass, for almost everything;
- the implementation's documented error (``mismatch_error``) on every rank, for a configured CP above 1 that
  disagrees with the process group (a configured CP of 1 is the design's silent no-op, unless ``checks_cp1``);
- a strict xfail for a known upstream limit the implementation declares, which must fail in exactly the
  known way: every failure it reports carries the limit's signature (the case's name and plan lines do not
  count), so another bug on a known-limit case still fails it, and an unexpected pass means the limit is
  gone and the declaration must be updated.
"""

from __future__ import annotations

import re

from vdpcp.contract.protocol import KnownLimit
from vdpcp.impls import resolve
from vdpcp.matrix.budget import GiB, KiB, MiB, TiB, human
from vdpcp.matrix.case import Case

# Every verdict, the most telling first (docs/verdicts.md): a case's is the first that applies. The judge adds JUDGED
# to the run's (vdpcp.matrix.runner): xfail outranks what the run says, xpass only a correct run.
PRECEDENCE = ("resource", "xfail", "error", "unsharded-error", "fail", "plan-mismatch", "grad-written", "not-sharded",
              "unbalanced", "xpass", "replicated", "pass")
JUDGED = ("xfail", "xpass")
# pass and replicated are a correct run as the case expects it; xfail, a known upstream limit met the known way.
PASSING = ("pass", "replicated", "xfail")
# A case expected to fail a known way has one rank raise while the others wait in the collective, and that rank's
# error (its signature) is all the verdict needs: so the others get this long, not the harness's longer grace.
KNOWN_LIMIT_GRACE_S = 0.1


def known_limit(case: Case, backend: str) -> KnownLimit | None:
    """The upstream limit this case runs into on ``backend`` ("gloo" or "nccl"), as its implementation says. A
    limit that only the backward meets (``grads_only``) is none of an outputs-only case's, whatever the
    implementation answers for it: the matrix runs such a case precisely because its outputs are still checked."""
    if expects_group_error(case):
        return None  # a mismatch must raise the documented error, whatever else the case would run into
    limit = resolve(case.impl).known_limit(case, backend)
    return None if limit is not None and limit.grads_only and not case.grads else limit


def expects_group_error(case: Case) -> bool:
    """A configured CP size that disagrees with the group; a configured CP of 1 only where the implementation
    validates it (``checks_cp1``): by the design, CP 1 turns the feature off and reports no error."""
    if case.config_cp is None or case.config_cp == case.cp:
        return False
    return case.config_cp > 1 or resolve(case.impl).checks_cp1


def group_error_problems(case: Case, text: str) -> list[str]:
    """What the failure text of a process-group mismatch case lacks: the implementation's documented error
    (``mismatch_error``: its class and text; both sizes in vdpcp's words where it promises them) from every rank."""
    error, problems = resolve(case.impl).mismatch_error, []
    if error.text not in text:
        problems.append(f"no rank reported {error.text!r}")
    if error.names_sizes:
        said = re.findall(rf"{re.escape(error.text)}[^;\n]*", text)  # the errors' own words, not the harness's
        for size in (f"context_parallel_size={case.config_cp}", f"{case.cp} ranks"):
            if not any(size in words for words in said):
                problems.append(f"the error does not name {size!r}")
    headline = text.splitlines()[0] if text else ""
    raised = rf"raised (?:[\w.]*\.)?{re.escape(error.kind)}: [^;]*{re.escape(error.text)}"
    for rank in range(case.world_size):
        if not re.search(rf"rank {rank} {raised}", headline):
            problems.append(f"rank {rank} did not raise the documented {error.kind}")
    if "hung" in headline:
        problems.append("a rank hung")
    return problems


def judge(result, known_limits: bool = True) -> tuple[str, str]:
    """(verdict, why) of a CaseResult against the case's expectation, on the backend it ran on.

    Verdicts: those of the runner (pass, replicated, fail, plan-mismatch, grad-written, not-sharded, unbalanced, error,
    unsharded-error, resource), xfail (a known limit failed the known way), xpass (a strict xfail passed: the limit is gone). Only
    pass, replicated and xfail count as passing. ``known_limits=False`` judges as if the implementation declared
    none: an upstream bug's reproduction then fails until it is fixed (for its maintainer, `replay
    --no-known-limits`).
    """
    case = result.case
    if result.verdict == "resource":
        return "resource", resource_failure(result)
    if expects_group_error(case):
        problems = group_error_problems(case, result.error or "")
        return ("pass", "the documented error on every rank") if not problems else ("fail", "; ".join(problems))
    limit = known_limit(case, result.backend) if known_limits else None
    if limit is None:
        if result.verdict == "replicated":
            return "replicated", next(f"by its policy: {r.replicated}" for r in result.ranks if r.replicated)
        unchecked = getattr(result, "unchecked_grads", None)
        if unchecked and result.passed:
            return result.verdict, f"gradients not checked: {unchecked}"
        notes = getattr(result, "notes", ())
        return result.verdict, f"note: {notes[0]}" if notes and result.passed else ""
    if result.passed:
        return "xpass", f"expected to fail ({limit.name}) but passed: {limit.reason}"
    otherwise = [failure for failure in result.failures if not limit.shows(failure)]
    if result.failures and not otherwise:
        return "xfail", f"{limit.name}: {limit.reason}"
    signatures = " or ".join(repr(text) for text in (limit.signature, *limit.alternatives))
    return result.verdict, (f"expected {limit.name} ({signatures}) but failed otherwise"
                            + (f": {otherwise[0]}" if otherwise else ""))


# --- resource failures: a rank out of memory is told from every verdict on the encoder ---------------------

# What torch, the C++ runtime, CUDA and the kernel say when an allocation fails.
_OUT_OF_MEMORY = re.compile(r"MemoryError|OutOfMemoryError|can't allocate memory|std::bad_alloc|out of memory|"
                            r"Cannot allocate memory", re.IGNORECASE)
_TRIED = re.compile(r"[Tt]ried to allocate ([\d.]+) ?(bytes|[KMGT]iB|B)\b")
_SECTION = re.compile(r"^----- rank (\d+): (.+?) -----$", re.MULTILINE)
_HEADLINE_RANK = re.compile(r"rank (\d+) (raised .*?)(?=; rank \d+ |$)")


def out_of_memory(text: str) -> str | None:
    """``text`` (an exception's line) as "out of memory (tried to allocate 96.0 GiB: ...)", or None when it is
    not an allocation failure."""
    if not text or not _OUT_OF_MEMORY.search(text):
        return None
    line = re.sub(r"^raised |\[enforce fail at [^]]*\] (err == 0\. )?", "", " ".join(text.split())).rstrip(": ")
    tried = _TRIED.search(line)
    if tried is None:
        return f"out of memory ({_clip(line)})"
    number, unit = float(tried.group(1)), tried.group(2)
    size = human(number * {"bytes": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}[unit])
    return f"out of memory: tried to allocate {size} ({_clip(line)})"


def resource_failure(result) -> str | None:
    """"rank N ran out of memory: ..." for a CaseResult where some rank's allocation failed (it raised, or its
    unsharded encoder did), else None. A resource failure says nothing about the encoder or about sharding."""
    error = getattr(result, "error", None)
    if error:
        found = _SECTION.findall(error) or _HEADLINE_RANK.findall(error.splitlines()[0])
        for rank, what in found:
            if not what.startswith("raised "):
                continue  # a peer that hung or died quotes the raiser's error: the raiser is the one out of memory
            oom = out_of_memory(what)
            if oom is not None:
                return f"rank {rank} ran {oom}"
        return None
    for r in getattr(result, "ranks", ()):
        oom = out_of_memory(r.unsharded_error or "")
        if oom is not None:
            return f"rank {r.rank} ran {oom} in the unsharded encoder"
    return None


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
