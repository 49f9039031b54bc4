"""The merged loss (vdpcp.feature.loss), in one process: each rank's loss reads its own weights over the whole merged
stream; the tower sees the same loss the exact run and the regrouped reference take; the prompt's gradient is the
weights, bit for bit, summed over ranks too; and a backward that writes into the gradient it was handed changes the
prompt's gradient, where a replacing merge or a prompt that is a leaf would hide it."""

import pytest
import torch

from vdpcp.feature import loss
from vdpcp.feature.layout import zigzag_positions
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case
from vdpcp.tools.mutants import gradient_changed

SPEC = MicrobatchSpec(images=((16, 16), (8, 24), (24, 8)), seed=7, name="three")
SHAPES = {"features": (10, 6), "deepstack0": (10, 6)}
CPU = torch.device("cpu")


def _loss(cp=4, kind="rank", dtype=torch.float64):
    return loss.case_loss(Case(SPEC, cp, loss=kind), SPEC, SHAPES, dtype, CPU)


def _outputs(weight=None):
    w = weight if weight is not None else torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return {"features": torch.tanh(x @ w), "deepstack0": x @ w}, w


def test_a_ranks_loss_reads_its_own_weights_over_the_whole_merged_stream_of_every_output():
    case_loss = _loss()
    outputs, _ = _outputs()
    for rank in range(4):
        prompt = case_loss.prompt()
        stream = case_loss.stream_weights(rank)
        expected = sum((stream[n] * (prompt.streams[n] + torch.cat([torch.zeros(3, 6), t, torch.zeros(5, 6)]))).sum()
                       for n, t in outputs.items())
        assert loss.rank_loss(outputs, case_loss, prompt, rank) == expected
        assert all(torch.equal(stream[n][3:13], case_loss.weights[n][rank]) for n in SHAPES)  # vision rows
    assert not torch.equal(case_loss.stream_weights(0)["features"], case_loss.stream_weights(1)["features"])


@pytest.mark.parametrize("kind", ["rank", "zigzag"])
def test_outputs_of_one_shape_get_weights_of_their_own_so_swapping_them_changes_every_ranks_loss(kind):
    """With one weight for every output, a loss cannot tell two outputs of one shape apart: a gather that hands one
    output's gradient to the other (DeepStack levels cross-wired) would get the right gradients."""
    case_loss = _loss(4, kind)
    x, y = (torch.randn(10, 6, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (2, 3))
    reading = [r for r in range(4) if case_loss.weights["features"][r].any()]  # zigzag: a rank may hold no vision row
    assert reading
    for rank in reading:
        assert not torch.equal(case_loss.weights["features"][rank], case_loss.weights["deepstack0"][rank])
        text = case_loss.text["features"][rank]
        assert not text.any() or not torch.equal(text, case_loss.text["deepstack0"][rank])
        prompt = case_loss.prompt()
        swapped = {"features": prompt.streams["deepstack0"], "deepstack0": prompt.streams["features"]}
        assert loss.rank_loss({"features": x, "deepstack0": y}, case_loss, prompt, rank) != \
            loss.merged_loss({"features": y, "deepstack0": x}, loss.Prompt(prompt.tables, swapped),
                             case_loss.stream_weights(rank))


def test_the_tower_sees_under_the_merged_loss_what_the_exact_run_and_the_regrouped_reference_take():
    case_loss, summed = _loss(), {n: sum(w) for n, w in _loss().weights.items()}
    outputs, w = _outputs()
    loss.merged_loss(outputs, case_loss.prompt(), case_loss.stream_weights()).backward()
    merged = w.grad.clone()
    w.grad = None
    loss.features_loss(_outputs(w)[0], summed).backward()
    assert torch.equal(merged, w.grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rank", "zigzag"])
def test_the_prompts_gradient_is_the_weights_bit_for_bit_and_sums_over_ranks_exactly(dtype, kind):
    case_loss = _loss(8, kind, dtype)
    outputs = {n: torch.randn(s, dtype=dtype, requires_grad=True) for n, s in SHAPES.items()}
    got = []
    for rank in range(8):
        prompt = case_loss.prompt()
        loss.rank_loss(outputs, case_loss, prompt, rank).backward()
        assert all(torch.equal(prompt.grads()[n], case_loss.table_grads(rank)[n]) for n in SHAPES)
        got.append(prompt.grads())
    prompt = case_loss.prompt()
    loss.merged_loss(outputs, prompt, case_loss.stream_weights()).backward()
    for n in SHAPES:
        assert torch.equal(prompt.grads()[n], case_loss.table_grads()[n])
        assert torch.equal(sum(g[n].double() for g in got).to(dtype), prompt.grads()[n])  # any order, exact
    if kind == "zigzag":  # every row of the fused stream read by exactly the rank whose LM shard holds it
        held = torch.stack([case_loss.stream_weights(r)["features"].ne(0).all(dim=1) for r in range(8)])
        assert torch.equal(held, torch.stack([zigzag_positions(18, 8, r) for r in range(8)]))


def _prompt_grad(in_place: bool, merge, prompt_first: bool = True):
    """The prompt table's gradient under a merge, where the outputs' backward does or does not also double the
    gradient it was handed in place (and hands on what it got)."""
    case_loss = _loss(2)
    prompt = case_loss.prompt() if prompt_first else None
    outputs, _ = _outputs()

    def written(grad):
        kept = grad.clone()
        if in_place:
            grad.mul_(2)
        return kept

    outputs = {n: gradient_changed(t, written) for n, t in outputs.items()}
    prompt = prompt or case_loss.prompt()
    weights = case_loss.stream_weights(0)
    sum((weights[n] * merge(prompt.streams[n], t)).sum() for n, t in outputs.items()).backward()
    return prompt.grads()["features"]


def _replacing(stream, rows):
    merged = stream.clone()
    merged[3:13] = rows
    return merged


def test_a_backward_that_writes_into_its_gradient_changes_the_prompts_gradient_at_the_vision_rows():
    clean, written = _prompt_grad(False, loss.merged), _prompt_grad(True, loss.merged)
    assert torch.equal(clean, _loss(2).table_grads(0)["features"])
    tokens = _loss(2).tokens["features"]
    differ = clean[tokens].ne(written[tokens]).any(dim=1)
    assert differ.tolist() == [False] * 3 + [True] * 10 + [False] * 5


def test_a_replacing_merge_or_a_prompt_embedded_after_the_encode_would_hide_it():
    assert torch.equal(_prompt_grad(False, _replacing), _prompt_grad(True, _replacing))
    assert torch.equal(_prompt_grad(False, loss.merged, prompt_first=False),
                       _prompt_grad(True, loss.merged, prompt_first=False))
