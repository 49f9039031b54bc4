"""Fuzz: draw microbatches, run each sharded against unsharded, shrink the first failure, save it as a spec.

The placeholder path only runs for microbatches with fewer images (or tubelets) than CP ranks, so its bugs
look intermittent in training. The search draws exactly the microbatches that matter: media counts around
and below CP, odd and even patch grids, mixed sizes, videos cut into tubelets of T in {1, 2, 4}.

Hypothesis is the engine: a seeded search (same seed, same microbatches, no time limits in play), stopped
at the first failure and shrunk to the smallest spec (fewest media, smallest grids) that still fails *the
same way*: with the same ``signature``, not merely some failure. A spec the unsharded encoder rejects too
(an odd real grid with even padding off) is not a sharding failure and never counts as one. The failure is
saved as a self-describing case (vdpcp.matrix.saved: its CP size, implementation, flags and signature), and, as
hypothesis's example database does, the next search of the same configuration first replays the saved
failures in its folder, reporting one that still fails without searching at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Callable

from hypothesis import HealthCheck, Phase, Verbosity, find, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky, NoSuchExample

from vdpcp.feature.spec import DEFAULT_PATCH_DIM, MicrobatchSpec
from vdpcp.matrix import budget, saved
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import MESSAGES, CaseResult, run_case
from vdpcp.matrix.saved import name_with_cp

DEFAULT_BUDGET = 100  # microbatches drawn before giving up (shrinking runs come on top)
# Most failures are one rank raising while the others wait in the gather: the raising rank's error is the
# signature, so the others get a short grace, not the harness's default, before the search moves on.
FAULT_GRACE_S = 0.5
TUBELET_SIZES = (1, 2, 4)
MAX_GRID = 8  # patches per side: small enough for a fast case, big enough for mixed sizes
MAX_SEED = 2**16 - 1


# --- what to draw -------------------------------------------------------------------------------------


def microbatches(cp: int, patch_dim: int = DEFAULT_PATCH_DIM) -> st.SearchStrategy[MicrobatchSpec]:
    """Microbatches with 1..2*cp media items; shrinks towards one still 2x2-patch image, T=1, seed 0."""
    return st.sampled_from(TUBELET_SIZES).flatmap(lambda T: _microbatch(cp, T, patch_dim))


@st.composite
def _microbatch(draw, cp: int, T: int, patch_dim: int) -> MicrobatchSpec:
    media = draw(st.lists(_media(T), min_size=1, max_size=2 * cp))
    images = [(gh * patch_dim, gw * patch_dim) for (gh, gw), frames in media for _ in range(frames)]
    return MicrobatchSpec(
        images=tuple(images),
        num_frames=tuple(frames for _, frames in media) if T > 1 else None,
        temporal_patch_size=T,
        patch_dim=patch_dim,
        seed=draw(st.integers(0, MAX_SEED)),
        name="fuzz",
    )


def _media(T: int):
    """(grid, frames): a still image, or (T > 1) a video of 2..2T+1 frames, so a short last tubelet too."""
    frames = st.just(1) if T == 1 else st.one_of(st.just(1), st.integers(2, 2 * T + 1))
    return st.tuples(st.tuples(_side(), _side()), frames)


def _side():
    # Real frames have even grids; odd ones are drawn too (the tower pads them). Even first, so shrinking
    # ends on the smallest grid every configuration can encode: 2 patches.
    return st.one_of(st.integers(1, MAX_GRID // 2).map(lambda k: 2 * k), st.integers(1, MAX_GRID))


# --- how a case failed ----------------------------------------------------------------------------------

_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_NUMBERS = re.compile(r"#(?:, #)+")  # a shape or a list of sizes: its length changes as the spec shrinks too
_RANK_SECTION = re.compile(r"^----- rank (\d+): (.+?) -----$", re.MULTILINE)


def signature(result: CaseResult) -> str | None:
    """How a case failed, in words that survive shrinking: None for a pass, an unencodable spec or a rank out of
    memory (a resource failure says nothing about sharding).

    An error is the first raising rank's exception type and message; a failed check is the first failing
    rank's first check message. Numbers, and lists of them, become '#' (they change as the spec shrinks).
    """
    if result.passed or result.verdict in ("unsharded-error", "resource"):
        return None
    if result.verdict == "error":
        return "error: " + _normalized(failing_rank(result)[1])
    attr = MESSAGES[result.verdict]
    first = next(r for r in result.ranks if getattr(r, attr))
    return f"{result.verdict}: " + _normalized(getattr(first, attr)[0])


def failing_rank(result: CaseResult) -> tuple[int, str, str]:
    """(rank, what happened, its traceback section) of the rank to blame in an errored case.

    The first rank that raised; when none raised (one died or all hung), the first rank reported.
    """
    text = result.error or ""
    sections = list(_RANK_SECTION.finditer(text))
    if not sections:
        return -1, text.splitlines()[0] if text else "unknown error", text
    blamed = next((m for m in sections if m.group(2).startswith("raised ")), sections[0])
    following = sections[sections.index(blamed) + 1] if blamed is not sections[-1] else None
    body = text[blamed.start() : following.start() if following else len(text)].rstrip()
    return int(blamed.group(1)), blamed.group(2), body


def _normalized(text: str) -> str:
    return _NUMBERS.sub("#", _NUMBER.sub("#", re.sub(r"^rank \d+: ", "", text)))


# --- the search -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Search:
    """One fuzz run: the CP size, its budget and seed, and how each case departs from the feature as specified."""

    cp: int
    budget: int = DEFAULT_BUDGET
    seed: int = 0
    impl: str = "reference"
    split: str = "count"
    dtype: str = "float64"
    even_pad: bool = True
    mutant: str | None = None
    backend: str | None = None
    timeout: float | None = None

    def case(self, spec: MicrobatchSpec) -> Case:
        return Case(spec, self.cp, impl=self.impl, split=self.split, dtype=self.dtype, even_pad=self.even_pad, mutant=self.mutant)

    @property
    def tag(self) -> str:
        """Names the configuration in saved specs: "no-even-pad", "mutant-<name>", or "as-specified"."""
        parts = [self.impl] if self.impl != "reference" else []
        parts += [self.split] if self.split != "count" else []
        parts += [self.dtype] if self.dtype != "float64" else []
        parts += ["no-even-pad"] if not self.even_pad else []
        parts += [f"mutant-{self.mutant}"] if self.mutant else []
        return "-".join(parts) or "as-specified"

    def saved_here(self, out_dir: Path) -> list[Path]:
        """Saved failures in ``out_dir`` of exactly this configuration (other flags, other CP: not ours)."""
        mine = []
        for path in sorted(Path(out_dir).glob("*.json")):
            try:
                found = saved.load(path)
                case = found.to_case()
            except Exception:  # noqa: BLE001 - a stray or foreign file in the folder is not ours to judge
                continue
            if found.signature is not None and case == self.case(found.spec):
                mine.append(path)
        return mine


OnRun = Callable[["FuzzReport", MicrobatchSpec, CaseResult], None]


@dataclass
class Finding:
    spec: MicrobatchSpec  # shrunk
    signature: str
    result: CaseResult  # of the shrunk spec
    path: Path | None = None
    reproduced: bool = True  # False: hypothesis's rerun of the spec did not fail the same way (flaky)
    from_saved: bool = False  # a failure saved by an earlier search, replayed first


@dataclass
class FuzzReport:
    search: Search
    drawn: int = 0  # microbatches run before the first failure (all of them when nothing failed)
    shrink_runs: int = 0  # runs after it, while shrinking
    passed: int = 0
    unsharded_errors: int = 0  # specs the unsharded encoder rejects too: not sharding failures
    resource_failures: int = 0  # runs where a rank ran out of memory: not sharding failures either
    finding: Finding | None = None
    replayed: int = 0  # saved failures replayed before searching
    other_failures: dict[str, MicrobatchSpec] = field(default_factory=dict)  # other signatures met while shrinking

    @property
    def runs(self) -> int:
        return self.drawn + self.shrink_runs


def fuzz(search: Search, out_dir: str | Path | None = None, on_run: OnRun | None = None) -> FuzzReport:
    """Run the search; on a failure, shrink it and (with ``out_dir``) save the shrunk spec there.

    ``on_run(report, spec, result)`` is called after every microbatch (progress display, tests).
    """
    report = FuzzReport(search)
    if out_dir is not None and _replay_saved(search, Path(out_dir), report, on_run):
        return report
    target: list[str] = []  # the first failure's signature: shrinking must keep it
    last: list[tuple[MicrobatchSpec, CaseResult]] = []

    def fails_the_same_way(spec: MicrobatchSpec) -> bool:
        result = run_case(search.case(spec), backend=search.backend, timeout=search.timeout, fault_grace=FAULT_GRACE_S)
        sig = signature(result)
        _count(report, result, bool(target))
        if sig is not None and not target:
            target.append(sig)
        same = sig is not None and sig == target[0]
        if sig is not None and not same:
            report.other_failures.setdefault(sig, spec)
        if same:
            last[:] = [(spec, result)]
        if on_run is not None:
            on_run(report, spec, result)
        return same

    reproduced = True
    try:
        # Never a draw over the spec limit (vdpcp.matrix.budget): the drawn sizes are small, but the limit may be lowered.
        draws = microbatches(search.cp).filter(lambda spec: budget.fits(search.case(spec)))
        find(draws, fails_the_same_way, settings=_settings(search.budget), random=Random(search.seed))
    except NoSuchExample:
        return report
    except Flaky:  # the smallest failing spec passed when hypothesis ran it again: save it, say so
        reproduced = False
    spec, result = last[0]
    spec = MicrobatchSpec.from_dict({**spec.to_dict(), "name": name_with_cp(search.tag, search.cp)})
    report.finding = Finding(spec, target[0], result, reproduced=reproduced)
    if out_dir is not None:
        report.finding.path = saved.save(Path(out_dir) / f"{spec.name}.json", search.case(spec), target[0])
    return report


def _replay_saved(search: Search, out_dir: Path, report: FuzzReport, on_run) -> bool:
    """Run this configuration's saved failures first; True (with report.finding) when one still fails."""
    for path in search.saved_here(out_dir):
        found = saved.load(path)
        budget.check(found.to_case(), str(path))  # SpecTooLarge naming the file, before it runs
        result = run_case(found.to_case(), backend=search.backend, timeout=search.timeout, fault_grace=FAULT_GRACE_S)
        _count(report, result, False)
        report.replayed += 1
        if on_run is not None:
            on_run(report, found.spec, result)
        sig = signature(result)
        if sig is not None:
            report.finding = Finding(found.spec, sig, result, path=path, from_saved=True)
            return True
    return False


def _settings(budget: int) -> settings:
    # No database and no time-based behaviour, so a seed always replays the same search.
    return settings(
        max_examples=budget,
        database=None,
        deadline=None,
        derandomize=False,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )


def _count(report: FuzzReport, result: CaseResult, shrinking: bool) -> None:
    if shrinking:
        report.shrink_runs += 1
    else:
        report.drawn += 1
    report.passed += result.passed
    report.unsharded_errors += result.verdict == "unsharded-error"
    report.resource_failures += result.verdict == "resource"
