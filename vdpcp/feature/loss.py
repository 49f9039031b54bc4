"""The loss: what each CP rank's language model takes from the gathered outputs, through the merge a VLM makes.

A VLM's language model never reads the gathered features alone: it merges them into its text embedding stream at
the image-token positions and reads the merged stream. So for each output, each CP rank r embeds a prompt (a text
stream of TEXT_BEFORE + N + TEXT_AFTER rows looked up in a small learnable table, fixed per case: the same on every
rank and in the unsharded run), merges the N gathered rows into it and takes L_r = sum(W_r * merged). The unsharded
run, on the same rank, takes the sum over r of L_r. Both the tower's gradients and the prompt table's are then held
to the unsharded run's (vdpcp.oracle).

The merge adds the gathered rows onto the prompt's rows at the vision positions (DeepStack's merge into the hidden
stream), placed there by a concatenation: its backward hands the gathered rows a view of the merged stream's
gradient, the very buffer the prompt's own backward reads. The prompt is embedded before the vision encode, as a
VLM's forward embeds its tokens first, and autograd runs the later-made of two ready nodes first: the whole vision
backward, the gather's included, runs before the prompt's reads that buffer. A gather whose backward writes into the
gradient it was handed (an in-place all-reduce) so changes the prompt's gradient. A merge that replaces the rows
(``masked_scatter``, an index assignment) hands the gathered rows a copy, and a prompt that is a leaf has autograd
copy its gradient before any vision node runs: either would hide such a gather.

W_r is drawn per (spec seed, CP rank, output) as odd sixteenths: at the vision rows ``loss_weights`` (the features'
weights: d L_r / d output, what the gather's backward receives), at the text rows ``text_weights``. The prompt term
has no path to the tower, so the tower's gradients under the merged loss are those under sum(W_vision * output)
(``features_loss``), which the exact run (vdpcp.oracle.compare.rounding) and the regrouped reference
(vdpcp.oracle.compare.regrouped) take, on chunks and regroupings of the outputs a whole stream could not follow.
The prompt's gradient is W_r itself (the derivative of a weighted sum, an embedding lookup of distinct rows):
sixteenths, so its sum over any CP ranks is exact in every dtype and it is held bitwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vdpcp.feature.grads import grad_or_zeros
from vdpcp.feature.layout import zigzag_positions

# The prompt around the vision rows, which the zigzag loss's fused sequence is: text before and after the media.
TEXT_BEFORE, TEXT_AFTER = 3, 5
OUTPUT_SEED_STRIDE = 104_729  # output k's loss weights are drawn with seed + k * this (k = 0: the main features)
TEXT_SEED = 1_299_709  # the text rows' weights and the prompt table are drawn apart from the features' weights


@dataclass
class Loss:
    """One case's loss on one rank: per output, every CP rank's weights at the vision rows (``weights``) and at the
    text rows (``text``: [TEXT_BEFORE + TEXT_AFTER, ...] per rank), and the prompt table it merges into."""

    weights: dict[str, list[torch.Tensor]]
    text: dict[str, list[torch.Tensor]]
    tables: dict[str, torch.Tensor]
    tokens: dict[str, torch.Tensor]  # which table row each stream row embeds: each row once, so its gradient is W

    def prompt(self) -> Prompt:
        """The prompts embedded now, from fresh leaves of the same tables (call it before the encode it merges)."""
        tables = {name: t.detach().clone().requires_grad_(True) for name, t in self.tables.items()}
        return Prompt(tables, {name: t.index_select(0, self.tokens[name]) for name, t in tables.items()})

    def stream_weights(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """W over each output's whole merged stream: CP rank ``rank``'s, or summed over the ranks (None)."""
        ranks = range(len(next(iter(self.weights.values()), []))) if rank is None else [rank]
        return {name: sum(_stream(self.text[name][r], self.weights[name][r]) for r in ranks) for name in self.weights}

    def table_grads(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """What the prompt tables' gradients are under CP rank ``rank``'s loss (None: the summed loss)."""
        return {name: torch.zeros_like(w).index_copy(0, self.tokens[name], w)
                for name, w in self.stream_weights(rank).items()}


@dataclass
class Prompt:
    """The prompts of one run: their tables (leaves; their ``.grad`` is the text's gradient) and embedded streams."""

    tables: dict[str, torch.Tensor]
    streams: dict[str, torch.Tensor]

    def grads(self) -> dict[str, torch.Tensor]:
        return {name: grad_or_zeros(t) for name, t in self.tables.items()}


def case_loss(case, spec, shapes: dict[str, tuple], dtype, device) -> Loss:
    """The loss of ``case`` over outputs of ``shapes`` (by name, in order), on microbatch ``spec``."""
    weights, text, tables, tokens = {}, {}, {}, {}
    for k, (name, shape) in enumerate(shapes.items()):
        weights[name] = [loss_weights(case, spec, r, shape, dtype, device, output=k) for r in range(case.cp)]
        text[name] = [text_weights(case, spec, r, shape, dtype, device, output=k) for r in range(case.cp)]
        rows = TEXT_BEFORE + shape[0] + TEXT_AFTER
        seed = (TEXT_SEED * spec.seed + k) % 2**63
        gen = torch.Generator().manual_seed(seed)
        if torch.device(device).type == "cpu":
            table = torch.randn(rows, *shape[1:], generator=gen, dtype=torch.float64)
        else:
            table = _normal(seed, (rows, *shape[1:]), device)
        tables[name] = sixteenths(table).to(dtype=dtype, device=device)
        tokens[name] = torch.randperm(rows, generator=gen).to(device)
    return Loss(weights, text, tables, tokens)


def rank_loss(outputs: dict[str, torch.Tensor], loss: Loss, prompt: Prompt, rank: int) -> torch.Tensor:
    """L_rank: what this CP rank's language model takes from the gathered outputs merged into its prompt."""
    return merged_loss(outputs, prompt, loss.stream_weights(rank))


def merged_loss(outputs: dict[str, torch.Tensor], prompt: Prompt, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over outputs of sum(W * merged), W over each whole merged stream (Loss.stream_weights)."""
    return sum((weights[name] * merged(prompt.streams[name], t)).sum() for name, t in outputs.items())


def merged(stream: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``stream`` with ``rows`` added at its vision positions, placed by a concatenation (module docstring: why)."""
    before = stream.new_zeros(TEXT_BEFORE, *rows.shape[1:])
    after = stream.new_zeros(stream.shape[0] - TEXT_BEFORE - rows.shape[0], *rows.shape[1:])
    return stream + torch.cat([before, rows, after])


def features_loss(outputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over outputs of sum(W * output): the merged loss as the tower sees it (the prompt term has no path to it)."""
    return sum((weights[name] * t).sum() for name, t in outputs.items())


def loss_weights(case, spec, rank: int, shape, dtype, device, output: int = 0) -> torch.Tensor:
    """W_rank at one output's vision rows: deterministic per (spec seed, CP rank, output); under zigzag, zero outside
    the rank's LM shard (every output is over the same token rows)."""
    seed = (1_000_003 * spec.seed + rank + OUTPUT_SEED_STRIDE * output) % 2**63
    w = _drawn(seed, tuple(shape)) if torch.device(device).type == "cpu" else sixteenths(_normal(seed, shape, device))
    if case.loss == "zigzag":
        w = w * zigzag_rows(shape[0], case.cp, rank).to(w.device).unsqueeze(-1)
    return w.to(dtype=dtype, device=device, copy=True)  # the draw itself stays as drawn, for the next case


def text_weights(case, spec, rank: int, shape, dtype, device, output: int = 0) -> torch.Tensor:
    """W_rank at one output's text rows (TEXT_BEFORE of them, then TEXT_AFTER), drawn as loss_weights is, apart."""
    gen = torch.Generator().manual_seed((TEXT_SEED * spec.seed + 7 * rank + OUTPUT_SEED_STRIDE * output + 1) % 2**63)
    w = sixteenths(torch.randn(TEXT_BEFORE + TEXT_AFTER, *shape[1:], generator=gen, dtype=torch.float64))
    if case.loss == "zigzag":
        held = zigzag_positions(TEXT_BEFORE + shape[0] + TEXT_AFTER, case.cp, rank).to(torch.float64)
        w = w * torch.cat([held[:TEXT_BEFORE], held[TEXT_BEFORE + shape[0]:]]).reshape(-1, *[1] * (w.dim() - 1))
    return w.to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=8)
def _drawn(seed: int, shape: tuple) -> torch.Tensor:
    """A float64 draw of odd sixteenths on the host, kept for the cases after this one: the matrix runs each
    microbatch under several splits, losses and pixel paths one after another, the same draw each time, and the host
    draws serially (an accelerator's ranks draw on it instead: _normal)."""
    gen = torch.Generator().manual_seed(seed)
    return sixteenths(torch.randn(shape, generator=gen, dtype=torch.float64))


def _normal(seed: int, shape, device) -> torch.Tensor:
    """A float64 draw on an accelerator, by its own generator: every rank of a case runs on the same kind of device,
    so each draws the same. A real-size tower's weights and prompt tables are tens of millions of elements, which the
    host draws serially and the device in parallel, so none is kept between cases."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64, device=device)


def sixteenths(draw: torch.Tensor) -> torch.Tensor:
    """A draw as odd sixteenths in (-2, 2), never zero: any sum of up to 8 of them (a gather's backward over 8 CP
    ranks) is a multiple of 1/16 under 16 in magnitude, 8 significant bits, so exact in bf16, float32 and float64
    in any order. Every rank's rows then receive the same gradient bits however a collective adds, which the
    regrouped reference (vdpcp.oracle.compare.regrouped) needs to hold gradients bitwise."""
    return (torch.floor(draw.clamp(-2, 2 - 1 / 16) * 8) * 2 + 1) / 16


def zigzag_rows(num_vision: int, cp: int, rank: int) -> torch.Tensor:
    """Which vision rows rank ``rank`` holds when the fused text+vision sequence is CP-split zigzag-wise
    (vdpcp.feature.layout.zigzag_positions), so most ranks' gradient for an image comes from other ranks."""
    held = zigzag_positions(TEXT_BEFORE + num_vision + TEXT_AFTER, cp, rank)
    return held[TEXT_BEFORE : TEXT_BEFORE + num_vision].to(torch.float64)


def _stream(text: torch.Tensor, vision: torch.Tensor) -> torch.Tensor:
    return torch.cat([text[:TEXT_BEFORE], vision, text[TEXT_BEFORE:]])
