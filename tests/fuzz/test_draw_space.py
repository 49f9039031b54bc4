"""The space `vdpcp.tools.fuzz.microbatches` draws, pinned at both ends: 1..2*cp media items; grids of 1..8 patches a
side, odd ones too; for T > 1 stills and videos of 2..2T+1 frames (a short last tubelet among them); seeds
0..2**16-1. A derandomized sample shows nothing past an end drawn and (or `hypothesis.find`, where the sample
lacks it) each end drawn; and shrinking ends where the docstrings say: one still 2x2-patch image, T=1, seed 0,
an even grid before an odd one."""

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from vdpcp.feature.spec import DEFAULT_PATCH_DIM, MicrobatchSpec
from vdpcp.tools.fuzz import microbatches

CP = 1  # the cheapest draws (at most 2 media items); the seed, grid and frame strategies do not depend on cp
GRID_SIDES = range(1, 9)  # patches per side: 1..8
MAX_SEED = 2**16 - 1  # seeds span 16 bits
VIDEO_T = (2, 4)

# No database, no deadline, no health checks, derandomized: the same draws on every run, however loaded the machine.
QUIET = dict(database=None, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def _draws(cp: int, n: int) -> list[MicrobatchSpec]:
    drawn = []

    @settings(max_examples=n, phases=[Phase.generate], **QUIET)
    @given(microbatches(cp))
    def draw(spec):
        drawn.append(spec)

    draw()
    return drawn


def _drawable(condition, sample: list[MicrobatchSpec], cp: int = CP) -> MicrobatchSpec:
    """A drawn microbatch that meets ``condition``: from ``sample``, else the first of a search of up to 500 draws
    (hypothesis.errors.NoSuchExample: none can be drawn)."""
    found = next((spec for spec in sample if condition(spec)), None)
    return found or find(microbatches(cp), condition, settings=settings(max_examples=500, phases=[Phase.generate], **QUIET))


def _smallest(condition) -> MicrobatchSpec:
    """What shrinking a microbatch that meets ``condition`` ends on, as vdpcp.tools.fuzz shrinks (no explain phase)."""
    return find(microbatches(CP), condition, settings=settings(max_examples=500, phases=[Phase.generate, Phase.shrink], **QUIET))


@pytest.fixture(scope="module")
def drawn() -> list[MicrobatchSpec]:
    return _draws(CP, 100)


def _sides(spec: MicrobatchSpec) -> list[int]:
    return [g for grid in spec.grids for g in grid]


def _of_t(T: int, frames: int):
    return lambda spec: spec.temporal_patch_size == T and frames in spec.media_frames


# --- the ends of the space -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [CP, 3])
def test_media_items_reach_twice_cp_and_never_more(drawn, cp):
    sample = drawn if cp == CP else _draws(cp, 30)
    assert all(1 <= len(spec.media_frames) <= 2 * cp for spec in sample), max(len(s.media_frames) for s in sample)
    assert _drawable(lambda spec: len(spec.media_frames) == 2 * cp, sample, cp)


@pytest.mark.parametrize("T", VIDEO_T)
def test_videos_of_t_run_from_2_to_2t_plus_1_frames_a_short_last_tubelet_among_them(drawn, T):
    videos = sorted({n for spec in drawn if spec.temporal_patch_size == T for n in spec.media_frames if n > 1})
    assert all(n <= 2 * T + 1 for n in videos), (T, videos)
    assert _drawable(_of_t(T, 2), drawn)  # one tubelet (a short one for T=4)
    assert _drawable(_of_t(T, 2 * T + 1), drawn)  # two whole tubelets and a one-frame one


def test_grid_sides_reach_1_and_8_and_never_more(drawn):
    assert all(g in GRID_SIDES for spec in drawn for g in _sides(spec)), sorted({g for s in drawn for g in _sides(s)})
    assert _drawable(lambda spec: min(GRID_SIDES) in _sides(spec), drawn)
    assert _drawable(lambda spec: max(GRID_SIDES) in _sides(spec), drawn)


def test_seeds_reach_2_to_the_16_minus_1_and_never_more(drawn):
    assert all(0 <= spec.seed <= MAX_SEED for spec in drawn), max(spec.seed for spec in drawn)
    assert _drawable(lambda spec: spec.seed == MAX_SEED, drawn)


# --- what shrinking ends on ---------------------------------------------------------------------------------


def test_shrinks_to_one_still_2x2_patch_image_t1_seed_0():
    P = DEFAULT_PATCH_DIM
    still = MicrobatchSpec(images=((2 * P, 2 * P),), temporal_patch_size=1, seed=0, name="fuzz")
    assert _smallest(lambda spec: True) == still


@pytest.mark.parametrize("T", VIDEO_T)
def test_a_tubelet_size_shrinks_to_one_still_image(T):
    assert _smallest(lambda spec: spec.temporal_patch_size == T).media_frames == (1,)


def test_a_failure_needing_a_large_grid_shrinks_to_an_even_one():
    # Even sides are drawn first, so shrinking ends on the smallest even grid that still fails: real frames' grids.
    assert max(_sides(_smallest(lambda spec: max(_sides(spec)) >= 5))) == 6
