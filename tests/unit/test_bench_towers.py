"""vdpcp bench towers' summary: the figures a GPU runner's job is sized by, from the per-case rows."""

from vdpcp.bench import towers


def _row(impl, cp, seconds, world=None, passing=True):
    return {"impl": impl, "cp": cp, "world": world or cp, "seconds": seconds, "passing": passing, "ranks": []}


def test_the_summary_gives_each_subjects_median_every_subjects_median_and_the_wall():
    rows = [_row("reference", 2, 1.0), _row("reference", 2, 3.0), _row("qwen2_5_vl", 2, 9.0),
            _row("qwen2_5_vl", 4, 20.0), _row("qwen2_5_vl", 2, 50.0, world=4, passing=False)]  # CP 2 x DP 2: apart
    text = towers.summary(rows, 83.0)
    assert "reference CP 2: median case 2.00 s over 2 cases" in text
    assert "qwen2_5_vl CP 2: median case 9.00 s over 1 cases" in text
    assert "every subject CP 2: median case 3.00 s over 3 cases (target 5 s)" in text
    assert "every subject CP 4: median case 20.00 s over 1 cases" in text
    assert text[-1].startswith("5 cases, 4 passing, in 83.0 s wall")
