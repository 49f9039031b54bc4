"""The correctness matrix as data: named microbatches, what each one runs, and what is expected of it.

A scenario is a microbatch spec and the CP sizes it runs at; every scenario runs with the reference
(count, balanced and packed splits, the latter two only where their plan differs from an earlier split's)
and with MCore's helpers (count split only: MCore has no other). A representative subset, at least one per
family, also runs the zigzag loss. Every ``*.json`` under
fixtures/ (recursively) is a scenario too: the named ones below get their row of this table, any other
(a saved regression, say) gets the default row.

Expectations, decided from the case's shape and the backend, never from a previous run:
- pass, for almost everything;
- the documented error on every rank, for a config CP that disagrees with the process group;
- a strict xfail for a known upstream limit, which must fail in exactly the known way (an unexpected pass
  means the limit is gone and the table must be updated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vdpcp.case import IMPLS, LOSSES, Case
from vdpcp.model import output_tokens
from vdpcp.plan import STRATEGIES, mcore_gives_up
from vdpcp.sharded import plan_for, real_tokens
from vdpcp.spec import MicrobatchSpec, SpecError

CP_SIZES = (1, 2, 4, 8)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PLACEHOLDER_TOKENS = output_tokens((1, 1))  # a P x P placeholder: a 1x1 grid, padded to 2x2, one token


@dataclass(frozen=True)
class Scenario:
    family: str  # what it exercises, for the report: fewer-images, remainder, tubelets, ...
    spec: MicrobatchSpec
    cps: tuple[int, ...] = CP_SIZES
    zigzag: bool = False  # also run the zigzag loss (the representative subset)


def _spec(name: str, images, *, frames=None, T: int = 1, seed: int = 0) -> MicrobatchSpec:
    return MicrobatchSpec(
        images=tuple(tuple(s) for s in images),
        num_frames=None if frames is None else tuple(frames),
        temporal_patch_size=T,
        seed=seed,
        name=name,
    )


def _video(size, frames):
    return [size] * frames


# Sizes are pixels at the toy tower's patch_dim=4: [16, 24] is a 4x6 patch grid, 2x3 = 6 output tokens.
# Families follow the list; zigzag marks the representative subset (at least one per family).
SCENARIOS: tuple[Scenario, ...] = (
    # Fewer images than ranks: placeholders are injected and their outputs dropped again.
    Scenario("fewer-images", _spec("one-image", [[32, 24]], seed=1)),
    Scenario("fewer-images", _spec("three-images", [[16, 16], [24, 16], [16, 32]], seed=2), zigzag=True),
    # Images a multiple of every CP size. All the same size, so every rank holds as many tokens as every other
    # and MCore's gather backward runs even on gloo (its zigzag too).
    Scenario("exact-remainder", _spec("eight-equal", [[16, 16]] * 8, seed=3), zigzag=True),
    # The last rank takes the remainder. Sized so that at CP 2 and 4 every rank still holds 16 or 8 tokens
    # (the remainder rank's images are smaller), so MCore's gradients are checked on gloo too.
    Scenario("exact-remainder", _spec("remainder-even-tokens", [[16, 32]] * 3 + [[16, 16]] * 2, seed=4)),
    Scenario("exact-remainder", _spec("eleven-images", [[16, 16], [8, 24], [24, 24], [16, 8], [32, 16], [8, 8],
                                                        [16, 24], [24, 8], [8, 16], [32, 32], [16, 16]], seed=5),
             zigzag=True),
    # Mixed sizes, with odd patch grids (padded to even before the pixel shuffle) and a one-patch image the
    # size of a placeholder, which must not be mistaken for one; non-square grids both ways.
    Scenario("multi-image", _spec("mixed-sizes", [[4, 4], [12, 20], [40, 16], [8, 8], [20, 12], [16, 16],
                                                  [28, 36], [8, 4]], seed=6)),
    Scenario("multi-image", _spec("non-square", [[8, 48], [48, 8], [16, 40], [40, 12], [4, 32]], seed=7),
             zigzag=True),
    # Tubelets: T frames of a video encoded together; splits land on tubelet or media boundaries.
    Scenario("tubelets", _spec("video-t2-even", _video([16, 16], 4) + _video([16, 24], 6), frames=[4, 6], T=2, seed=8)),
    Scenario("tubelets", _spec("video-t2-ragged", _video([16, 16], 5) + _video([24, 16], 3), frames=[5, 3], T=2, seed=9)),
    Scenario("tubelets", _spec("video-t4-even", _video([16, 16], 8) + _video([8, 24], 8), frames=[8, 8], T=4, seed=10)),
    Scenario("tubelets", _spec("video-t4-ragged", _video([16, 16], 6) + _video([16, 8], 9), frames=[6, 9], T=4, seed=11)),
    Scenario("tubelets", _spec("few-tubelets-t2", _video([16, 24], 3), frames=[3], T=2, seed=12), cps=(2, 4, 8)),
    Scenario("tubelets", _spec("few-tubelets-t4", _video([16, 16], 5), frames=[5], T=4, seed=13), cps=(2, 4, 8)),
    # One 6-frame video in tubelets of 3 at CP=4: MCore's split gives up (vdpcp.plan.mcore_gives_up) and its
    # features come out wrong, a strict xfail; the reference splits the two tubelets by count.
    Scenario("tubelets", _spec("mcore-give-up-t3", _video([16, 16], 6), frames=[6], T=3, seed=16), cps=(4,)),
    Scenario("tubelets", _spec("video-and-images", [[16, 16]] + _video([16, 24], 4) + [[24, 8]]
                               + _video([8, 16], 5) + [[16, 16]], frames=[1, 4, 1, 5, 1], T=2, seed=14),
             zigzag=True),
)

# The dataset-shaped fixtures (fixtures/*.json) by name: (family, zigzag).
DATASET_FIXTURES = {"doc-qa": ("dataset", False), "multi-image": ("dataset", True), "video": ("dataset", False)}

# Opt-out at CP > 1: vision_dp_over_cp=False must give the unsharded result on every rank.
OPT_OUT = (("three-images", (2, 4, 8)), ("video-and-images", (2, 8)))
# Config CP != process group size: (group size, configured context_parallel_size).
MISMATCHES = ((2, 4), (4, 2), (4, 1), (8, 4))
EMPTY = _spec("empty", [], seed=15)
GROUP_MISMATCH_TEXT = "vision_dp_over_cp does not match its process group"


# --- expectations --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownLimit:
    """An upstream limit: the case must fail, and its failure text must contain ``signature``."""

    name: str
    reason: str
    signature: str


GLOO_GATHER_BACKWARD = KnownLimit(
    "gloo-gather-backward",
    "MCore's gather_from_context_parallel_ranks_dynamic_res backward runs torch.distributed.nn's all_to_all, "
    "which on gloo is a scatter that needs equal tensor sizes: it fails when CP ranks hold different token "
    "counts (runs for real on NCCL)",
    "ProcessGroupGloo::scatter: invalid tensor size",
)
MCORE_EMPTY_MICROBATCH = KnownLimit(
    "mcore-empty-microbatch",
    "MCore 0.19.2 pads an empty microbatch to one placeholder per rank, then its gather drops every rank's "
    "output and torch.cat gets an empty list",
    "expected a non-empty list of Tensors",
)
MCORE_TUBELET_GIVE_UP = KnownLimit(
    "mcore-tubelet-give-up",
    "MCore 0.19.2's tubelet-aware split still leaves a rank empty after its re-plans and then cuts, drops or "
    "misplaces real frames (see vdpcp.plan.mcore_gives_up)",
    "",  # any failure: outputs of the wrong shape, or a rank that raised
)


# A case expected to fail this way has one rank raise while the others wait in the collective: the raising
# rank's error is all the verdict needs, so the others get this long, not the harness's default grace.
KNOWN_LIMIT_GRACE_S = 0.5


def rank_tokens(case: Case) -> list[int]:
    """Output tokens each rank's encoder yields under the case's plan, placeholders included."""
    plan = plan_for(case.spec, case.config)
    return [real + PLACEHOLDER_TOKENS * s.num_placeholders for real, s in zip(real_tokens(plan), plan.shards)]


def known_limit(case: Case, backend: str) -> KnownLimit | None:
    """The upstream limit this case runs into on ``backend`` ("gloo" or "nccl"), if any."""
    if case.impl != "mcore" or not case.config.shard_vision or case.config_cp is not None:
        return None
    spec = case.spec
    if not spec.images:
        return MCORE_EMPTY_MICROBATCH
    if spec.temporal_patch_size > 1 and mcore_gives_up(spec.media_frames, case.cp, spec.temporal_patch_size):
        return MCORE_TUBELET_GIVE_UP
    if case.grads and backend == "gloo" and len(set(rank_tokens(case))) > 1:
        return GLOO_GATHER_BACKWARD
    return None


def expects_group_error(case: Case) -> bool:
    return case.config_cp is not None and case.config_cp != case.cp


def group_error_problems(case: Case, text: str) -> list[str]:
    """What the failure text of a process-group mismatch case lacks: the documented error from every rank."""
    problems = []
    if GROUP_MISMATCH_TEXT not in text:
        problems.append(f"no rank reported {GROUP_MISMATCH_TEXT!r}")
    for size in (f"context_parallel_size={case.config_cp}", f"{case.cp} ranks"):
        if size not in text:
            problems.append(f"the error does not name {size!r}")
    headline = text.splitlines()[0] if text else ""
    for rank in range(case.cp):
        if not re.search(rf"rank {rank} raised ([\w.]+\.)?GroupMismatchError: [^;]*{GROUP_MISMATCH_TEXT}", headline):
            problems.append(f"rank {rank} did not raise GroupMismatchError")
    if "hung" in headline:
        problems.append("a rank hung")
    return problems


# --- verdicts ------------------------------------------------------------------------------------------

PASSING = ("pass", "xfail")


def judge(result, backend: str) -> tuple[str, str]:
    """(verdict, why) of a CaseResult against the case's expectation.

    Verdicts: pass, fail, error (as the runner says), xfail (a known limit failed the known way), xpass (a
    strict xfail passed: the limit is gone). Only pass and xfail count as passing.
    """
    case = result.case
    text = result.summary()
    if expects_group_error(case):
        problems = group_error_problems(case, result.error or "")
        return ("pass", "the documented error on every rank") if not problems else ("fail", "; ".join(problems))
    limit = known_limit(case, backend)
    if limit is None:
        return result.verdict, ""
    if result.passed:
        return "xpass", f"expected to fail ({limit.name}) but passed: {limit.reason}"
    if limit.signature in text:
        return "xfail", f"{limit.name}: {limit.reason}"
    return result.verdict, f"expected {limit.name} ({limit.signature!r}) but failed otherwise"


# --- the matrix ----------------------------------------------------------------------------------------


def fixture_specs(root: Path = FIXTURES) -> list[tuple[Path, MicrobatchSpec]]:
    """Every *.json under ``root`` (recursively), sorted by path; a bad file raises SpecError naming it."""
    return [(path, MicrobatchSpec.load(path)) for path in sorted(root.rglob("*.json"))] if root.is_dir() else []


def scenarios(fixtures: Path | None = FIXTURES) -> list[Scenario]:
    """The table above plus one scenario per fixture file; spec names must be unique (they name the cases)."""
    table = list(SCENARIOS)
    if fixtures is not None:
        for path, spec in fixture_specs(fixtures):
            family, zigzag = DATASET_FIXTURES.get(spec.name, (_family_of(path, fixtures), False))
            table.append(Scenario(family, spec, zigzag=zigzag))
    _check_unique(table)
    return table


def spec_scenarios(path: Path, cps=CP_SIZES) -> list[Scenario]:
    """Scenarios for a spec file, or every *.json under a folder, run at ``cps`` with the default row."""
    path = Path(path)
    if path.is_dir():
        pairs = fixture_specs(path)
        if not pairs:
            raise SpecError(f"{path}: no *.json spec files under this folder")
    else:
        pairs = [(path, MicrobatchSpec.load(path))]
    table = [Scenario(_family_of(p, path if path.is_dir() else p.parent), spec, tuple(cps)) for p, spec in pairs]
    _check_unique(table)
    return table


def cases_of(scenario: Scenario, cps=CP_SIZES, impls=IMPLS, splits=STRATEGIES, losses=LOSSES) -> list[Case]:
    """One scenario's cases at the given CP sizes, in the matrix's order (see matrix)."""
    out = []
    for cp in (c for c in scenario.cps if c in cps):
        for loss in (loss for loss in LOSSES if loss in losses and (loss == "rank" or scenario.zigzag)):
            for impl in (i for i in IMPLS if i in impls):
                for split in (s for s in STRATEGIES if s in splits and (impl == "reference" or s == "count")):
                    case = Case(scenario.spec, cp, impl, split, loss)
                    if split != "count" and (loss != "rank" or _same_plan_as_an_earlier_split(case)):
                        continue  # the zigzag subset runs the count split; an identical plan is an identical run
                    out.append(case)
                    if impl == "mcore" and loss == "rank" and cp > 1 and len(set(rank_tokens(case))) > 1:
                        # Ranks hold different token counts: the gradient case cannot run on gloo, so the
                        # outputs are also checked on their own, on every backend.
                        out.append(case.with_(grads=False))
    return out


def _same_plan_as_an_earlier_split(case: Case) -> bool:
    """True when a split listed before the case's in STRATEGIES plans the same shards in the same order."""
    if not case.config.shard_vision:
        return True
    plan = plan_for(case.spec, case.config)
    earlier = STRATEGIES[: STRATEGIES.index(case.split)]
    return any(_same_plan(plan, plan_for(case.spec, case.with_(split=s).config)) for s in earlier)


def _same_plan(a, b) -> bool:
    return a.shards == b.shards and a.order == b.order


def matrix(cps=CP_SIZES, impls=IMPLS, splits=STRATEGIES, losses=LOSSES, table: list[Scenario] | None = None,
           special: bool = True) -> list[Case]:
    """Every case, CP size outermost (the harness rebuilds its process group only when the size changes).

    ``special`` adds the opt-out, process-group mismatch and empty-microbatch rows.
    """
    table = scenarios() if table is None else table
    by_name = {s.spec.name: s for s in table}
    out = []
    for cp in sorted(cps):
        for scenario in table:
            out += cases_of(scenario, (cp,), impls, splits, losses)
        if not special:
            continue
        out += cases_of(Scenario("empty", EMPTY), (cp,), impls, splits, ("rank",))
        for name, opt_cps in OPT_OUT:
            if cp in opt_cps and name in by_name:
                out += [Case(by_name[name].spec, cp, impl, vision_dp_over_cp=False) for impl in IMPLS if impl in impls]
        for group, configured in MISMATCHES:
            if group == cp:
                spec = by_name.get("three-images", Scenario("", EMPTY)).spec
                out += [Case(spec, cp, impl, config_cp=configured) for impl in IMPLS if impl in impls]
    return out


def family_of(case: Case, table: list[Scenario] | None = None) -> str:
    """The scenario family a case belongs to (special rows are their own family)."""
    if expects_group_error(case):
        return "group-mismatch"
    if not case.vision_dp_over_cp:
        return "opt-out"
    if case.spec == EMPTY:
        return "empty"
    for scenario in scenarios() if table is None else table:
        if scenario.spec.name == case.spec.name:
            return scenario.family
    return "spec"


def _family_of(path: Path, root: Path) -> str:
    parent = path.parent.relative_to(root) if path.parent != root else Path()
    return str(parent) if str(parent) != "." else "fixture"


def _check_unique(table: list[Scenario]) -> None:
    seen: dict[str, Scenario] = {}
    for s in table:
        if s.spec.name in seen and seen[s.spec.name].spec != s.spec:
            raise SpecError(f"two different microbatch specs are both named {s.spec.name!r}; case ids need unique names")
        seen[s.spec.name] = s
