"""The correctness matrix as data: named microbatches, the CP sizes and layouts each runs at, and its cases.

A scenario is a microbatch spec and the CP sizes it runs at; every scenario runs with every implementation
asked for, in each split it implements (a split other than count only where its plan differs from an earlier
split's). A representative subset, at least one per family, also runs the zigzag loss, and another subset
runs in layouts with data parallelism around CP (world = CP x DP, each replica its own microbatch). Every
``*.json`` under fixtures/ (recursively) is a scenario too: the named ones below get their row of this table,
any other (a saved regression, say) gets the default row. What each case is expected to do is
vdpcp.matrix.expectations' business, not this table's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from vdpcp.contract.protocol import MediaAxes
from vdpcp.feature.pixels import loader_pixels
from vdpcp.feature.plan import STRATEGIES
from vdpcp.feature.sharded import plan_for
from vdpcp.feature.spec import DEFAULT_PATCH_DIM, MicrobatchSpec, SpecError
from vdpcp.impls import BUILT_INS, resolve
from vdpcp.matrix.case import LOSSES, Case

CP_SIZES = (1, 2, 4, 8)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"  # package data: an installed vdpcp runs the same matrix
# (CP, DP) layouts beyond world == CP: each DP replica encodes its own microbatch on its own CP group.
LAYOUTS = ((2, 2), (4, 2), (2, 4))
# (CP, TP) layouts for implementations whose tower is tensor parallel: a rank that skips its tower hangs its peers.
TP_LAYOUTS = ((2, 2), (4, 2))


@dataclass(frozen=True)
class Scenario:
    family: str  # what it exercises, for the report: fewer-images, remainder, tubelets, ...
    spec: MicrobatchSpec
    cps: tuple[int, ...] = CP_SIZES
    zigzag: bool = False  # also run the zigzag loss (the representative subset)
    layouts: bool = False  # also run with data parallelism around CP (LAYOUTS)
    adapt: bool = True  # drawn anew for each implementation's tower (its MediaAxes); a user's spec file is run as it is


def _spec(name: str, images, *, frames=None, T: int = 1, seed: int = 0, P: int = DEFAULT_PATCH_DIM) -> MicrobatchSpec:
    return MicrobatchSpec(
        images=tuple(tuple(s) for s in images),
        num_frames=None if frames is None else tuple(frames),
        temporal_patch_size=T,
        patch_dim=P,
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
    Scenario("fewer-images", _spec("three-images", [[16, 16], [24, 16], [16, 32]], seed=2), zigzag=True, layouts=True),
    # Images a multiple of every CP size. All the same size, so every rank holds as many tokens as every other
    # and MCore's gather backward runs even on gloo (its zigzag too).
    Scenario("exact-remainder", _spec("eight-equal", [[16, 16]] * 8, seed=3), zigzag=True),
    # The last rank takes the remainder. Sized so that at CP 2 and 4 every rank still holds 16 or 8 tokens
    # (the remainder rank's images are smaller), so MCore's gradients are checked on gloo too.
    Scenario("exact-remainder", _spec("remainder-even-tokens", [[16, 32]] * 3 + [[16, 16]] * 2, seed=4)),
    Scenario("exact-remainder", _spec("eleven-images", [[16, 16], [8, 24], [24, 24], [16, 8], [32, 16], [8, 8],
                                                        [16, 24], [24, 8], [8, 16], [32, 32], [16, 16]], seed=5),
             zigzag=True, layouts=True),
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
    # One 6-frame video in tubelets of 3 at CP=4: MCore's split gives up (vdpcp.feature.plan.mcore_gives_up) and its
    # features come out wrong, a strict xfail; the reference splits the two tubelets by count.
    Scenario("tubelets", _spec("mcore-give-up-t3", _video([16, 16], 6), frames=[6], T=3, seed=16), cps=(4,)),
    Scenario("tubelets", _spec("video-and-images", [[16, 16]] + _video([16, 24], 4) + [[24, 8]]
                               + _video([8, 16], 5) + [[16, 16]], frames=[1, 4, 1, 5, 1], T=2, seed=14),
             zigzag=True, layouts=True),
)

# The size people train (``--tower real``): microbatches that mean something to a published tower, in pixels at
# patch 14 (Qwen2.5-VL's; drawn anew at each tower's own patch, grids kept: 448 px is a 32x32 grid, 512 px at
# patch 16): 224-1344 px images, one tall 1344 px, odd patch grids (33x47, 31x31), a ragged video at T=2.
# The names match toy rows that play the same part, so the named mutants' kill sets find them at either size.
# The three-images microbatch is the one whose bf16 outputs a correct implementation failed element-wise (the
# precision model, vdpcp.oracle.compare.precision).
REAL_CPS = (2, 4, 8)


def _real(name: str, images, **kw) -> MicrobatchSpec:
    return _spec(name, images, P=14, **kw)


REAL_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("fewer-images", _real("one-image", [[448, 448]], seed=1), REAL_CPS),
    Scenario("fewer-images", _real("three-images", [[448, 448], [224, 336], [672, 448]], seed=2), REAL_CPS,
             zigzag=True, layouts=True),
    Scenario("multi-image", _real("multi-image", [[1344, 448], [448, 448], [448, 672], [336, 448]], seed=6), REAL_CPS),
    Scenario("multi-image", _real("mixed-sizes", [[462, 658], [224, 896], [896, 224], [434, 434]], seed=7), REAL_CPS),
    # Thirty-two 224 px images, 8192 patches, 2048 merged tokens: at automodel-shipped's released thresholds (2048
    # tokens, 32 frames), so its sharded path runs at the size people train too (it replicates every other real row).
    Scenario("multi-image", _real("multi-image-32", [[224, 224]] * 32, seed=18), REAL_CPS),
    # A ragged video, then a short one: an even split of the frames lands inside a tubelet at CP 2 and 4.
    Scenario("tubelets", _real("video-and-images", [[448, 448]] + _video([336, 448], 5) + _video([336, 448], 2),
                               frames=[1, 5, 2], T=2, seed=14), REAL_CPS),
)
TOWER_TABLES = {"toy": SCENARIOS, "real": REAL_SCENARIOS}
# The real-size row that plays each toy row's part where the real table has no row of that name (a mutant's kill
# set names toy rows): the same kind of microbatch, at the size people train.
REAL_STAND_INS = {"eight-equal": "three-images", "remainder-even-tokens": "three-images", "eleven-images": "mixed-sizes",
                  "non-square": "mixed-sizes", "video-t2-even": "video-and-images", "video-t4-ragged": "video-and-images",
                  "video-t2-ragged": "video-and-images", "empty": "one-image"}


def stand_in(case_id: str, tower: str) -> str:
    """A toy case id as the id of the case that plays its part at ``tower``'s size."""
    if tower == "toy":
        return case_id
    names = sorted({s.spec.name for s in SCENARIOS} | {EMPTY.name} | set(REAL_STAND_INS), key=len, reverse=True)
    name = next((n for n in names if case_id.startswith(f"{n}-cp")), None)
    if name is None:
        return f"{case_id}-tower-{tower}"
    return f"{REAL_STAND_INS.get(name, name)}{case_id[len(name):]}-tower-{tower}"

# The dataset-shaped fixtures (fixtures/*.json) by name: (family, zigzag).
DATASET_FIXTURES = {"doc-qa": ("dataset", False), "multi-image": ("dataset", True), "video": ("dataset", False)}

# Opt-out at CP > 1: vision_dp_over_cp=False must give the unsharded result on every rank.
OPT_OUT = (("three-images", (2, 4, 8)), ("video-and-images", (2, 8)))
# Config CP != process group size: (CP group size, configured context_parallel_size, DP replicas). A configured
# CP of 1 turns the feature off (the design's no-op: no error, no collective, every rank encodes everything), unless
# the implementation validates it (Implementation.checks_cp1): vdpcp.matrix.expectations decides which.
MISMATCHES = ((2, 4, 1), (4, 2, 1), (4, 1, 1), (8, 4, 1), (2, 4, 2))
EMPTY = _spec("empty", [], seed=15)


# --- the matrix ----------------------------------------------------------------------------------------


def fixture_specs(root: Path = FIXTURES) -> list[tuple[Path, MicrobatchSpec]]:
    """Every *.json under ``root`` (recursively), sorted by path; a bad file raises SpecError naming it."""
    from vdpcp.matrix import saved

    return [(path, saved.load(path).spec) for path in sorted(root.rglob("*.json"))] if root.is_dir() else []


def scenarios(fixtures: Path | None = FIXTURES, tower: str = "toy") -> list[Scenario]:
    """The table of a tower size (the toy one plus one scenario per fixture file, whose sizes are the toy tower's);
    spec names must be unique (they name the cases)."""
    if tower not in TOWER_TABLES:
        raise SpecError(f"tower size {tower!r} has no scenario table; expected one of {', '.join(TOWER_TABLES)}")
    table = list(TOWER_TABLES[tower])
    if fixtures is not None and tower == "toy":
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
        from vdpcp.matrix import saved

        pairs = [(path, saved.load(path).spec)]
    table = [Scenario(_family_of(p, path if path.is_dir() else p.parent), spec, tuple(cps), adapt=False)
             for p, spec in pairs]
    _check_unique(table)
    return table


def cases_of(scenario: Scenario, cps=CP_SIZES, impls=BUILT_INS, splits=None, losses=LOSSES, dp: int = 1,
             tp: int = 1, primary: bool = False, tower: str = "toy") -> list[Case]:
    """One scenario's cases at the given CP sizes (and DP replicas, TP size), in the matrix's order (see matrix).

    ``splits``: the partitions to run (None: every one each implementation names); ``primary``: only each
    implementation's first partition (the layouts and special rows); ``tower``: the size of every case's tower
    (implementations that do not come in it have no cases).
    """
    out = []
    for cp in (c for c in scenario.cps if c in cps):
        for loss in (loss for loss in LOSSES if loss in losses and (loss == "rank" or scenario.zigzag)):
            for impl in (i for i in impls if tp == 1 or tp in resolve(i).tensor_parallel):
                media = resolve(impl).towers.get(tower)
                spec = spec_for(scenario, media) if media is not None else None
                if spec is None:
                    continue
                own = resolve(impl).splits
                for split in [s for s in (own[:1] if primary else own) if splits is None or s in splits]:
                    case = Case(spec, cp, impl, split, loss, dp=dp, tp=tp, tower=tower)
                    if split != own[0] and (loss != "rank" or _same_plan_as_an_earlier_split(case, own)):
                        continue  # the zigzag subset runs the first split; an identical plan is an identical run
                    out.append(case)
                    out += outputs_only(case)
    return out


def spec_for(scenario: Scenario, media: MediaAxes) -> MicrobatchSpec | None:
    """The scenario's microbatch as it means something to a tower that takes ``media``: sizes scaled to its
    patch size (grids kept), grids below its minimum raised to it, odd grid sides rounded up to even where it takes
    even grids only (a placeholder the split injects stays as the split makes it), tubelets at the largest T it
    takes."""
    spec = scenario.spec
    if not scenario.adapt:
        return spec
    T = spec.temporal_patch_size
    if media.temporal_patch_sizes is not None and T not in media.temporal_patch_sizes:
        fits = [t for t in media.temporal_patch_sizes if t <= T]
        if not fits:
            return None
        T = max(fits)
    images = tuple((_side(h, spec.patch_dim, media), _side(w, spec.patch_dim, media)) for h, w in spec.images)
    P = media.patch_dim
    if (images, T, P) == (spec.images, spec.temporal_patch_size, spec.patch_dim):
        return spec
    return replace(spec, images=images, temporal_patch_size=T, patch_dim=P,
                   num_frames=spec.num_frames if spec.num_frames is not None or T == 1 else spec.media_frames)


def _side(pixels: int, patch_dim: int, media: MediaAxes) -> int:
    """One side of an image, in pixels at ``media``'s patch size: its patch grid kept, raised to the minimum, and
    rounded up to even where the tower takes even grids only."""
    grid = max(pixels // patch_dim, media.min_grid)
    return (grid + grid % 2 * media.even_grids) * media.patch_dim


def large_scenarios(media: MediaAxes, cps=CP_SIZES) -> list[Scenario]:
    """Where a tower takes another path below ``min_rows_per_rank`` patch rows per rank: at each CP size, a
    remainder of 2 x CP + 1 images each larger than that alone, so every rank's share is past it."""
    if media.min_rows_per_rank <= 0:
        return []
    grid = math.isqrt(media.min_rows_per_rank) + 1
    grid += grid % 2  # even, so merging towers take it as it is
    size = [grid * media.patch_dim] * 2
    return [Scenario("large", _spec(f"large-cp{cp}", [size] * (2 * cp + 1), seed=40 + cp), (cp,), adapt=False)
            for cp in cps]


def implementation_scenarios(impl: str) -> list[Scenario]:
    """The implementation's own rows of the matrix: past its local floor, and the microbatches it adds itself."""
    subject = resolve(impl)
    own = [Scenario("own", item, adapt=False) if isinstance(item, MicrobatchSpec)
           else Scenario("own", item[0], tuple(item[1]), adapt=False) for item in subject.scenarios()]
    return large_scenarios(subject.media) + own


def outputs_only(case: Case) -> list[Case]:
    """The case with outputs alone, where some backend's known limit stops only its backward: the outputs
    are then still checked, on every backend."""
    if case.loss != "rank" or case.cp == 1:
        return []
    limit = resolve(case.impl).known_limit(case, "gloo")
    return [case.with_(grads=False)] if limit is not None and limit.grads_only else []


@dataclass(frozen=True)
class LeftOut:
    """Gradient cases a known limit stops on their backend, left out once a case of theirs confirms it."""

    limit: str
    backend: str
    confirmed_by: str  # the id of the case that runs, a strict xfail that must fail the known way
    cases: tuple[str, ...]

    def line(self) -> str:
        return (f"{len(self.cases)} more gradient case(s) that {self.limit} stops on {self.backend} are left out, "
                f"confirmed by {self.confirmed_by}; their outputs run in their -outputs cases")


def confirm_once(cases: list[Case], backend_of) -> tuple[list[Case], list[LeftOut]]:
    """The cases to run, and those left out: a known limit that stops only the backward (KnownLimit.grads_only) on
    a case's backend (``backend_of(case)``) is confirmed by its first case of each implementation, CP size,
    layout, dtype and pixels, a strict xfail that must still fail the known way; its other gradient cases there are
    left out when their outputs-only case is in ``cases`` (the outputs are what such a case can check on that
    backend; its gradients run for real where the limit does not apply; a loader twin's is its tower case's). Each
    stopped case would be a fault and fresh rank workers to say the same thing again."""
    from vdpcp.matrix.expectations import known_limit

    ids = {case.id for case in cases}
    kept, confirmed, left = [], {}, {}
    for case in cases:
        backend = backend_of(case)
        limit = known_limit(case, backend) if case.grads else None
        # the same forward: the loss changes only the gradients (the matrix has no outputs-only loader twin)
        twin = case.with_(loss="rank", grads=False, pixels="tower").id
        if limit is None or not limit.grads_only or twin not in ids:
            kept.append(case)
            continue
        key = (case.impl, limit.name, backend, case.cp, case.dp, case.tp, case.dtype, case.mutant, case.pixels)
        if key not in confirmed:
            confirmed[key] = case.id
            kept.append(case)
        else:
            left.setdefault(key, []).append(case.id)
    return kept, [LeftOut(key[1], key[2], confirmed[key], tuple(ids_)) for key, ids_ in left.items()]


def _same_plan_as_an_earlier_split(case: Case, splits) -> bool:
    """True when a split listed before the case's plans the same shards in the same order (for vdpcp's own
    strategies, whose plans it can compute; an implementation's own partitions always run)."""
    if not case.config.shard_vision:
        return True
    if case.split not in STRATEGIES:
        return False
    plan = plan_for(case.spec, case.config)
    earlier = [s for s in splits[: splits.index(case.split)] if s in STRATEGIES]
    return any(_same_plan(plan, plan_for(case.spec, case.with_(split=s).config)) for s in earlier)


def _same_plan(a, b) -> bool:
    return a.shards == b.shards and a.order == b.order


def matrix(cps=CP_SIZES, impls=BUILT_INS, splits=None, losses=LOSSES, table: list[Scenario] | None = None,
           special: bool = True, layouts: bool = True, tower: str = "toy") -> list[Case]:
    """Every case, grouped by world size (the harness rebuilds its process group only when that changes), then by
    implementation (a rank builds each implementation's model once and reuses it, vdpcp.oracle.model_cache).

    ``special`` adds the opt-out, process-group mismatch and empty-microbatch rows, and each implementation's
    own scenarios (implementation_scenarios); ``layouts`` the CP x DP cases of the scenarios marked for them
    (at the CP sizes asked for), and their CP x TP cases for the implementations with a tensor-parallel tower.
    At a tower size other than the toy one, the table is that size's and the special rows are the opt-out only
    (the others are decided before any tower runs: the toy size covers them).
    """
    table = scenarios(tower=tower) if table is None else table
    toy = tower == "toy"
    by_name = {s.spec.name: s for s in table}
    own = {impl: implementation_scenarios(impl) for impl in impls} if special and toy else {}
    out = []

    def rows(scenario, cp, impls=impls, losses=losses, **kw):
        return cases_of(scenario, (cp,), impls, splits, losses, tower=tower, **kw)

    for cp in sorted(cps):
        for scenario in table:
            out += rows(scenario, cp)
        for impl, extra in own.items():
            for scenario in extra:
                out += rows(scenario, cp, (impl,))
        if layouts:
            for scenario in (s for s in table if s.layouts):
                for dp in (d for c, d in LAYOUTS if c == cp and (toy or d == 2)):
                    out += rows(scenario, cp, losses=("rank",), dp=dp, primary=True)
                for tp in (t for c, t in TP_LAYOUTS if c == cp):
                    out += rows(scenario, cp, losses=("rank",), tp=tp, primary=True)
        if not special:
            continue
        if toy:
            out += rows(Scenario("empty", EMPTY), cp, losses=("rank",), primary=True)
        for name, opt_cps in OPT_OUT:
            if cp in opt_cps and name in by_name and (toy or (cp, name) == (min(opt_cps), OPT_OUT[0][0])):
                out += [c.with_(vision_dp_over_cp=False) for c in rows(by_name[name], cp, losses=("rank",), primary=True)
                        if c.grads]
        three = by_name.get("three-images", Scenario("", EMPTY))
        for group, configured, dp in MISMATCHES if toy else ():
            if group == cp:
                out += [c.with_(config_cp=configured, dp=dp) for c in rows(replace(three, cps=(cp,)), cp, losses=("rank",),
                                                                           primary=True) if c.grads]
    out += [case.with_(pixels="loader") for case in out if _loader_twin(case)]
    order = {impl: i for i, impl in enumerate(impls)}
    return sorted(out, key=lambda case: (case.world_size, order.get(case.impl, 0)) if not toy else case.world_size)


def _loader_twin(case: Case) -> bool:
    """Whether the matrix also runs ``case`` with its pixels as a data loader hands them (vdpcp.feature.pixels): where an
    implementation's own cast and move meet a rank with placeholders or no image (fewer units than ranks), or mixed
    sizes. Each implementation's first split, the rank loss, with gradients: what follows the pixels' dtype or
    device is decided by the forward's shapes, not by the loss or the split."""
    subject = resolve(case.impl)
    if loader_pixels(subject) is None or case.pixels != "tower" or not case.grads:
        return False
    if (case.cp, case.dp, case.tp, case.loss, case.config_cp) != (case.cp, 1, 1, "rank", None) or case.cp == 1:
        return False
    if not case.vision_dp_over_cp or case.mutant or case.split != subject.splits[0]:
        return False
    return case.spec.num_tubelets < case.cp or case.spec.name == "mixed-sizes"


def family_of(case: Case, table: list[Scenario] | None = None) -> str:
    """The scenario family a case belongs to (special rows are their own family)."""
    if case.config_cp == 1:
        return "cp1-off"  # the design's silent no-op, whatever the group
    if case.config_cp is not None:
        return "group-mismatch"
    if case.dp > 1 or case.tp > 1:
        return "layout"
    if not case.vision_dp_over_cp:
        return "opt-out"
    if case.spec == EMPTY:
        return "empty"
    for scenario in (scenarios() if table is None else table) + implementation_scenarios(case.impl):
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
