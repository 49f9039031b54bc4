"""The CP x TP reference: the unsharded reference of a CP x TP case is the PLAIN tower with the same weights, and
the TP tower is held to the plain tower on its own, forward and backward, on a TP group of two ranks.

Before, the reference was the TP tower itself, so a TP bug present on both sides cancelled (a backward without
its all-reduce moved input grads by 0.24 and passed); the tp-*-not-reduced mutants (tests/mutants) are that bug.
"""

import pytest
import torch
import torch.distributed as dist

from vdpcp.feature.model import TowerConfig, VisionModel
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.feature.tensor_parallel import ParallelMLP, held_part, parallelize
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.tools import mutants

SPEC = MicrobatchSpec(images=((16, 16), (8, 24), (24, 8)), seed=5, name="three")
MLP = ("0.weight", "0.bias", "2.weight", "2.bias")


def _said(what: str):
    return lambda mismatch: f"{what}: {mismatch}"


def _marked(model) -> list[str]:
    return [name for name, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)]


def test_the_reference_of_a_tp_case_is_the_plain_tower_with_the_weights_of_the_tp1_case():
    impl = resolve("reference")
    plain = impl.build_model(Case(SPEC, 2), torch.float64, torch.device("cpu"))
    reference = impl.build_model(Case(SPEC, 2, tp=2), torch.float64, torch.device("cpu"))
    assert not any(isinstance(m, ParallelMLP) for m in reference.modules()) and _marked(reference) == []
    assert reference.state_dict().keys() == plain.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


def tp_against_plain(ctx, spec: MicrobatchSpec, dtype: torch.dtype):
    """On each rank of a TP group (the world): the plain tower and its TP copy, forward and backward."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    plain = VisionModel(TowerConfig(seed=spec.seed)).to(dtype)
    subject = VisionModel(TowerConfig(seed=spec.seed)).to(dtype)
    subject.load_state_dict(plain.state_dict())
    parallelize(subject, ctx.group)

    # It is split: the MLPs' sharded parameters are 1/TP of the plain ones, under the plain names.
    names = [name for name, _ in plain.named_parameters()]
    assert [name for name, _ in subject.named_parameters()] == names
    assert _marked(subject) == [f"blocks.{i}.mlp.{p}" for i in range(len(plain.blocks)) for p in MLP[:3]]
    for (name, p), q in zip(subject.named_parameters(), plain.parameters()):
        if name in _marked(subject):
            assert p.numel() * tp == q.numel(), name
        torch.testing.assert_close(p.detach(), held_part(q.detach(), p, rank, tp), rtol=0, atol=0, msg=_said(name))

    outputs, input_grads = [], []
    for model in (plain, subject):
        batch = spec.tensors(dtype=dtype)
        batch.patches.requires_grad_(True)
        out = model(batch.patches, batch.imgs_sizes, spec.num_frames)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64).to(dtype)
        (weight * out).sum().backward()
        outputs.append(out.detach())
        input_grads.append(batch.patches.grad)
    torch.testing.assert_close(outputs[1], outputs[0], msg=_said("outputs"))
    torch.testing.assert_close(input_grads[1], input_grads[0], msg=_said("input grads"))
    for (name, p), q in zip(subject.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, held_part(q.grad, p, rank, tp), msg=_said(f"grad of {name}"))
    return outputs[1].double().norm().item()


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_tp_tower_computes_the_plain_towers_outputs_and_gradients(run_ranks, dtype):
    norms = run_ranks(tp_against_plain, 2, SPEC, dtype)
    assert norms[0] == norms[1] > 0  # both TP ranks hold the same, non-trivial, features


def tp_against_plain_under(ctx, mutant: str, spec: MicrobatchSpec, dtype: torch.dtype):
    """tp_against_plain with a TP mutant in force: the first line of what it caught (None: it caught nothing)."""
    with mutants.applied(mutant, None):
        try:
            tp_against_plain(ctx, spec, dtype)
        except AssertionError as caught:
            return str(caught).splitlines()[0]
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("mutant, caught", [("tp-forward-not-reduced", "outputs"),
                                            ("tp-backward-not-reduced", "input grads")])
def test_a_tp_tower_without_its_all_reduce_is_caught_on_its_own(run_ranks, mutant, caught):
    for line in run_ranks(tp_against_plain_under, 2, mutant, SPEC, torch.float64):
        assert line is not None and line.startswith(f"{caught}: Tensor-likes are not close!"), line


def test_held_part_is_the_ranks_chunk_along_the_marked_dimension_and_rejects_a_wrong_size():
    full = torch.arange(24.0).reshape(4, 6)
    column, row, whole = torch.zeros(2, 6), torch.zeros(4, 3), torch.zeros(4, 6)
    column.tensor_model_parallel, column.partition_dim = True, 0
    row.tensor_model_parallel, row.partition_dim = True, 1
    assert torch.equal(held_part(full, column, 1, 2), full[2:])
    assert torch.equal(held_part(full, row, 0, 2), full[:, :3]) and torch.equal(held_part(full, row, 1, 2), full[:, 3:])
    assert held_part(full, whole, 1, 2) is full
    with pytest.raises(ValueError, match=r"not 1/4 of the plain tensor's \(4, 6\)"):
        held_part(full, column, 0, 4)
