"""What the busiest GPU holds where a case's ranks do not divide over the GPUs (vdpcp.matrix.budget): the busiest GPU takes
the ranks rounded UP (5 ranks on 2 GPUs: 3 on one of them), taking turns for the unsharded arm where more than one
shares it. Rounded down, it would be sized for too few ranks on 2 GPUs (1 of 3, no turns: too small) and for none,
read as every rank at once, on 4 (too large)."""

import pytest

from vdpcp.feature.spec import MicrobatchSpec, SpecTooLarge
from vdpcp.matrix import budget
from vdpcp.matrix.case import Case

SPEC = MicrobatchSpec(images=((16, 16), (16, 32)) * 6, name="twelve")


@pytest.mark.parametrize("ranks, gpus, busiest", [(3, 2, 2), (5, 2, 3), (3, 4, 1), (6, 4, 2)])
def test_the_busiest_gpu_holds_the_ranks_rounded_up_taking_turns_where_they_share_it(monkeypatch, ranks, gpus, busiest):
    monkeypatch.setattr(budget, "gpu_count", lambda: gpus)
    case = Case(SPEC, ranks)
    found = budget.need(case, device="cuda")
    held = found.colocated(turns=busiest > 1, ranks=busiest)
    assert held < found.colocated(turns=False), "the figure must tell one GPU's ranks from every rank at once"
    with budget.limited(held):
        budget.check(case, device="cuda")  # at that figure it fits
    with budget.limited(held - 1), pytest.raises(SpecTooLarge) as refused:
        budget.check(case, device="cuda")  # one byte less, it does not
    text = str(refused.value)
    assert f"the case needs about {budget.human(held)} on the busiest GPU (" in text, text
    sharing = f"its {busiest} ranks taking turns for the unsharded arm" if busiest > 1 else "(one rank;"
    assert sharing in text, text
