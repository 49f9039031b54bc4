"""Which microbatch rows a rank's tower read (vdpcp.oracle.observe.split.read_table), where its tower took something that is not
the microbatch's pixels: a learned placeholder (a parameter, as a learned pad token is) on a rank that holds no image.
That rank read no row, and reading it is no error; next to a real row, only the real row is read. In-process: one CP
rank, its sum over the group its own table."""

import torch

from vdpcp import oracle
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.oracle.observe import reads, split

SPEC = MicrobatchSpec(images=((8, 8), (8, 8)), name="two")


def _read(feed) -> list[list[bool]]:
    """The read table of one rank whose tower is fed ``feed(patches, placeholder)`` (patches: [rows, 3 P^2])."""
    batch = SPEC.tensors()
    width = batch.patches.shape[-1]
    tower = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.Linear(4, 2)).double()
    placeholder = torch.nn.Parameter(torch.zeros(2, width, dtype=torch.float64))
    with oracle.Execution(tower) as ran, reads.coded(batch) as coded:
        tower(feed(coded.patches[0], placeholder))
    return split.read_table(SPEC, ran, 1, 0, None, batch.patches.device).tolist()


def test_a_rank_whose_tower_took_only_a_learned_placeholder_read_no_row(one_rank_sums):
    assert _read(lambda patches, placeholder: placeholder) == [[False, False]]


def test_beside_a_learned_placeholder_the_real_rows_its_tower_took_are_read(one_rank_sums):
    rows = SPEC.row_patches[0]
    assert _read(lambda patches, placeholder: torch.cat([patches[rows:], placeholder])) == [[False, True]]
