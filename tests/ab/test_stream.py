"""The A/B's microbatches: every run crosses a placeholder microbatch and a remainder microbatch, whatever the
dataset, and is the same every time for the same seed."""

import pytest

from vdpcp.feature.datasets import generate
from vdpcp.tools.ab.stream import cut, kind_of, schedule


@pytest.mark.parametrize("dataset", ["doc-qa", "multi-image", "video"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_five_step_run_has_placeholder_and_remainder_microbatches(dataset, cp):
    draws = [d for step in schedule(dataset, cp, steps=5, accumulate=2, seed=0, tower="toy") for d in step]
    assert len(draws) == 10
    assert {"placeholders", "remainder"} <= {d.kind for d in draws}
    assert all(d.kind == kind_of(d.spec, cp) for d in draws)


def test_the_schedule_is_a_function_of_its_arguments():
    assert schedule("video", 2, 3, 2, seed=5, tower="toy") == schedule("video", 2, 3, 2, seed=5, tower="toy")
    assert schedule("video", 2, 3, 2, seed=5, tower="toy") != schedule("video", 2, 3, 2, seed=6, tower="toy")


@pytest.mark.parametrize("units", [1, 2, 3, 5])
def test_a_video_is_cut_on_a_tubelet_boundary(units):
    spec = generate("video", 0, samples=3, patch_dim=4, downscale=4)
    assert cut(spec, units).num_tubelets == units
