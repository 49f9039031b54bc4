"""Load balance of the count and balanced splits, the references they are judged against, and the chart."""

import functools

import pytest

from vdpcp.feature import balance
from vdpcp.feature.balance import SPLIT_NAMES, compare, split_balance, unit_costs
from vdpcp.feature.datasets import DATASETS, generate
from vdpcp.feature.plan import COSTS
from vdpcp.feature.spec import MicrobatchSpec

SEEDS = range(100)
ALPHA = balance.REAL_TOWER_ALPHA


def spec_of(*grids, patch_dim=16):
    return MicrobatchSpec(images=tuple((gh * patch_dim, gw * patch_dim) for gh, gw in grids), patch_dim=patch_dim)


# --- hand-worked microbatch: patches 4, 4, 16 on 2 ranks -----------------------------------------


def test_count_vs_balanced_by_hand():
    spec = spec_of((2, 2), (2, 2), (4, 4))
    count, balanced = compare(spec, 2, alpha=0)[:2]
    assert [r.load["patches"] for r in count.ranks] == [4, 20]  # one image each, remainder on the last rank
    assert [r.load["patches"] for r in balanced.ranks] == [8, 16]
    assert count.ideal["patches"] == 12 and count.lower_bound["patches"] == 16  # the 16-patch image is whole
    assert count.to_ideal("patches") == pytest.approx(20 / 12)
    assert count.to_lower_bound("patches") == pytest.approx(20 / 16)
    assert balanced.to_lower_bound("patches") == 1.0
    # alpha = 0: the attention cost is p^2
    assert [r.load["attention"] for r in count.ranks] == [16, 16 + 256]
    assert count.ideal["attention"] == (16 + 16 + 256) / 2


def test_placeholders_are_reported_and_left_out_of_the_references():
    spec = spec_of((4, 4))
    for split in SPLIT_NAMES:
        b = split_balance(spec, 4, split)
        assert [r.images for r in b.ranks] == [1, 0, 0, 0]
        assert [r.placeholders for r in b.ranks] == [0, 1, 1, 1]
        assert b.ideal["patches"] == 4 and b.lower_bound["patches"] == 16  # the one image is the bound
        assert b.to_lower_bound("patches") == 1.0


# --- properties over the generators ---------------------------------------------------------------


def optimal_contiguous_bottleneck(costs, parts):
    """Independent check: dynamic programme over prefix sums (not the planner's binary search)."""
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @functools.cache
    def best(end, k):  # first `end` units in `k` non-empty groups
        if k == 1:
            return prefix[end]
        return min(max(best(cut, k - 1), prefix[end] - prefix[cut]) for cut in range(k - 1, end))

    return best(len(costs), parts)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_balanced_never_leaves_a_hotter_rank_than_count(name, cp):
    for seed in SEEDS:
        spec = generate(name, seed)
        count, by_patches, by_attention = compare(spec, cp, ALPHA)[:3]
        assert by_patches.busiest("patches") <= count.busiest("patches"), seed
        assert by_attention.busiest("attention") <= count.busiest("attention"), seed


@pytest.mark.parametrize("cp", [4, 8])
@pytest.mark.parametrize("cost", COSTS)
def test_balanced_is_the_best_order_preserving_split(cost, cp):
    """So where it misses the lower bound, no split that keeps image order (as the gather needs) meets it."""
    for seed in range(30):
        spec = generate("multi-image", seed)
        b = split_balance(spec, cp, f"balanced:{cost}", ALPHA)
        assert b.busiest(cost) == optimal_contiguous_bottleneck(unit_costs(spec, cost, ALPHA), cp), seed


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_is_within_one_unit_of_the_ideal(cp):
    for seed in SEEDS:
        spec = generate("multi-image", seed)
        for cost in COSTS:
            b = split_balance(spec, cp, f"balanced:{cost}", ALPHA)
            assert b.busiest(cost) <= b.ideal[cost] + max(unit_costs(spec, cost, ALPHA)), (seed, cost)


@pytest.mark.xfail(
    strict=True,
    reason="the 5% balance target is out of reach of any order-preserving split at ~36 images per microbatch: the "
    "balanced split is the contiguous optimum (test above), yet up to 1.11x (CP=4) and 1.20x (CP=8) the lower "
    "bound max(largest image, total/CP), which is not attainable in general; see docs/perf/balance.md",
)
@pytest.mark.parametrize("cp", [4, 8])
def test_issue_target_contiguous_balanced_within_5_percent_of_lower_bound(cp):
    worst = max(split_balance(generate("multi-image", s), cp, "balanced:patches").to_lower_bound("patches") for s in SEEDS)
    assert worst <= balance.TARGET_TO_LOWER_BOUND


@pytest.mark.parametrize("cp", [4, 8])
@pytest.mark.parametrize("cost", COSTS)
def test_issue_target_packed_within_5_percent_of_lower_bound(cost, cp):
    """The 5% balance target, met by the split that may reorder images (the gather puts them back in order)."""
    worst = max(split_balance(generate("multi-image", s), cp, f"packed:{cost}", ALPHA).to_lower_bound(cost) for s in SEEDS)
    assert worst <= balance.TARGET_TO_LOWER_BOUND


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_packed_never_leaves_a_hotter_rank_than_balanced_or_lpt(name, cp):
    for seed in range(40):
        spec = generate(name, seed)
        for cost in COSTS:
            packed = split_balance(spec, cp, f"packed:{cost}", ALPHA).busiest(cost)
            assert packed <= split_balance(spec, cp, f"balanced:{cost}", ALPHA).busiest(cost), (seed, cost)
            assert packed <= balance.unordered_busiest(unit_costs(spec, cost, ALPHA), cp), (seed, cost)


def test_count_split_is_reported_far_from_the_bound_at_cp8():
    """Pitfall 2, measured: the count split's busiest rank on multi-image data is far above the bound."""
    rows = balance.sweep([generate("multi-image", s) for s in range(40)], [8])
    by = {(r.split, r.cost): r for r in rows}
    assert by[("count", "patches")].mean_to_lower_bound > by[("balanced:patches", "patches")].mean_to_lower_bound
    assert by[("unordered LPT (reference)", "patches")].mean_to_lower_bound <= by[("balanced:patches", "patches")].mean_to_lower_bound


# --- tables and chart -----------------------------------------------------------------------------


def test_tables_have_a_row_per_rank_and_per_split():
    balances = compare(generate("multi-image", 0), 4)
    assert balance.rank_table(balances).count("\n") == 1 + 4 * len(SPLIT_NAMES)
    assert balance.summary_table(balances).count("\n") == 1 + len(SPLIT_NAMES)


@pytest.mark.parametrize("kind", ["ranks", "sweep"])
def test_chart_is_a_non_empty_png(tmp_path, kind):
    specs = [generate("multi-image", s) for s in range(3)]
    if kind == "ranks":
        path = balance.plot_ranks([b for cp in (2, 4) for b in compare(specs[0], cp)], tmp_path / "c.png")
    else:
        path = balance.plot_sweep(balance.sweep(specs, [2, 4]), tmp_path / "c.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
