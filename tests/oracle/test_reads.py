"""Which microbatch rows a tower read, seen at its inputs (vdpcp.oracle.observe.reads, through vdpcp.oracle.Execution): every row's
code is exact in each dtype and survives the moves a split makes, under no_grad too; a tubelet row names both its
frames; placeholders and padding name nothing; a copy that lost its codes (detached, inference mode) is found by
its bytes, a constant row never; and the tower itself never sees a tangent. In one process."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from vdpcp import oracle
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls.qwen2_5_vl import Qwen25VL
from vdpcp.oracle.observe import reads

DTYPES = (torch.float64, torch.float32, torch.bfloat16)
MIXED = MicrobatchSpec(images=((8, 8), (4, 8), (8, 4), (12, 8)), name="mixed")  # 4, 2, 2 and 6 patches


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_rows_code_is_exact_and_decodes_after_casts(dtype):
    rows = torch.arange(2000)
    codes = reads.code(rows).to(dtype)
    for moved in (codes, codes.to(torch.float32).to(dtype), codes.type(torch.float64), codes.to(torch.bfloat16)):
        assert torch.equal(reads.decode(moved), rows)


def test_each_rows_names_are_the_rows_its_elements_name():
    """A row naming one microbatch row (an image's patch), a tubelet's two frames in any order, and elements that
    name none among them: each row's set, as reading its elements one by one gives it."""
    named = torch.tensor([[4, 4, 4, 4], [7, 2, 7, 2], [-1, 5, -1, 5], [3, -1, 9, 1], [0, 0, -1, -1]])
    assert reads.named_rows(named) == [{4}, {2, 7}, {5}, {1, 3, 9}, {0}]
    gen = torch.Generator().manual_seed(0)
    drawn = torch.randint(-1, 5, (64, 12), generator=gen)
    drawn[:, 0] = drawn[:, 0].clamp_min(0)  # every row names one at least, as the coded rows Index.learn keeps
    assert reads.named_rows(drawn) == [frozenset(r for r in line if r >= 0) for line in drawn.tolist()]


def test_zero_and_values_made_of_codes_are_no_row():
    codes = reads.code(torch.tensor([3, 200]))
    assert reads.decode(torch.stack([torch.tensor(0.0, dtype=torch.float64), codes[0] * 1.001, -codes[1]])).tolist() \
        == [-1, -1, -1]


def _read(spec, dtype, feed, index=None, learn=False):
    """The rows a two-layer tower read, fed ``feed(coded patches [N, D])``; and the input its first layer got."""
    batch = spec.tensors(dtype=dtype)
    width = batch.patches.shape[-1]
    tower = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.Linear(4, 2)).to(dtype)
    got = []
    tower[0].register_forward_pre_hook(lambda module, args: got.append(args[0]))  # after Execution's: what it handed on
    with oracle.Execution(tower, index, learn) as ran, reads.coded(batch) as coded:
        tower(feed(coded.patches[0]))
    return sorted(ran.read), got[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_split_under_no_grad_reads_its_rows_and_hands_the_tower_no_tangent(dtype):
    def split(patches):  # rows 1 and 3, cast and back, and a zero placeholder patch, under no_grad
        with torch.no_grad():
            own = torch.cat([patches[4:6], patches[8:14]]).to(torch.float32).to(dtype).clone()
            assert not own.requires_grad
            return torch.cat([own, own.new_zeros(1, own.shape[1])])

    read, handed = _read(MIXED, dtype, split)
    assert read == [1, 3]
    assert fwAD.unpack_dual(handed).tangent is None and handed.shape[0] == 9


def test_a_tubelet_row_names_both_of_its_frames():
    spec = MicrobatchSpec(images=((8, 8),) * 3 + ((8, 8),), num_frames=(3, 1), temporal_patch_size=2, name="video")
    batch = spec.tensors()
    impl, index = Qwen25VL(), reads.Index()
    with reads.coded(batch) as coded:
        pixels = impl.inputs(coded).pixel_values  # [tubelet rows, C*T*P*P]: frames 0+1, then frame 2 twice, then the image
        tower = torch.nn.Sequential(torch.nn.Linear(pixels.shape[1], 2)).double()
        with oracle.Execution(tower, index, learn=True) as ran:
            tower(pixels)
    assert sorted(ran.read) == [0, 1, 2, 3]
    assert sorted(set(index.rows.values()), key=sorted) == [frozenset({0, 1}), frozenset({2}), frozenset({3})]


@pytest.mark.parametrize("lose", ["detach", "inference_mode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_copy_without_codes_is_found_by_its_bytes_and_a_constant_row_never(dtype, lose):
    index = reads.Index()
    read, _ = _read(MIXED, dtype, lambda patches: torch.cat([patches, patches.new_zeros(2, patches.shape[1])]), index,
                    learn=True)
    assert read == [0, 1, 2, 3] and len(index.rows) == 14  # every patch, not the two zero rows

    def copied(patches):  # rows 2 and 3, codes lost, beside a zero row and a row of another value alike
        if lose == "detach":
            rows = patches[6:].detach()
        else:
            with torch.inference_mode():
                rows = patches[6:] * 1
        return torch.cat([rows.clone(), torch.zeros(1, rows.shape[1], dtype=dtype),
                          torch.full((1, rows.shape[1]), 0.5, dtype=dtype)])

    assert _read(MIXED, dtype, copied, index)[0] == [2, 3]


def test_rows_with_no_code_and_no_index_are_read_by_no_one():
    assert _read(MIXED, torch.float64, lambda patches: patches.detach())[0] == []


def test_a_keyword_input_is_read_and_handed_on_without_its_tangent():
    class Embed(torch.nn.Module):  # a layer with a parameter of its own, called by keyword
        def __init__(self, width):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(width, 2, dtype=torch.float64))

        def forward(self, *, pixels):
            assert fwAD.unpack_dual(pixels).tangent is None
            return pixels @ self.weight

    batch = MIXED.tensors()
    tower = torch.nn.ModuleDict({"embed": Embed(batch.patches.shape[-1])})
    with oracle.Execution(tower) as ran, reads.coded(batch) as coded:
        tower["embed"](pixels=coded.patches[0, :4])
    assert ran.read == {0}


def test_pixels_that_require_grad_keep_their_gradient_through_the_codes():
    batch = MIXED.tensors()
    batch.patches.requires_grad_(True)
    tower = torch.nn.Sequential(torch.nn.Linear(batch.patches.shape[-1], 2)).double()
    with oracle.Execution(tower) as ran, reads.coded(batch) as coded:
        out = tower(coded.patches[0, 4:8])
    out.sum().backward()
    assert ran.read == {1, 2}
    assert batch.patches.grad[0, 4:8].ne(0).all() and not batch.patches.grad[0, :4].any()
