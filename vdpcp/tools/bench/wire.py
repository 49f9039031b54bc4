"""Bytes on the wire of the one gather: projected features, against gathering the encoder output first.

Counted, not timed: bytes that leave a rank, summed over the CP group, for one microbatch. The encoder
output is the pixel-shuffled feature (4 x vision hidden per token); the projector maps it to the language
model's hidden size, so projecting first moves lm_hidden / (4 x hidden) of the bytes (and keeps the
projector's compute sharded). Two gathers are counted:
- mcore: gather_from_context_parallel_ranks_dynamic_res, an all_to_all that sends each rank's whole local
  tensor (placeholder outputs too) to every other rank; its backward sends the same volume back;
- reference: vdpcp.feature.comm.gather_features, every shard padded to the longest, then an all_gather; its
  backward all-reduces the whole gathered gradient (counted as a ring: 2 (CP-1)/CP of it per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vdpcp.cli.exit_codes import Exit

if TYPE_CHECKING:
    from vdpcp.feature.plan import Plan

MIB = 2**20
# (name, vision hidden, language model hidden)
TOWERS = (
    ("bench tower", 1024, 2688),  # the memory benchmark's tower; lm_hidden as Nemotron-3 Nano's
    ("RADIO-H-like", 1280, 2688),  # assumed sizes of an Omni-like model: ViT-H vision, 2688-wide LM
    ("toy tower", 32, 48),  # the correctness suite's tower
)


def local_tokens(plan: Plan) -> list[int]:
    """Tokens each rank hands the gather: its units' pixel-shuffled outputs, placeholders included."""
    from vdpcp.feature.model import output_tokens  # torch, imported only when counting

    tokens = []
    for shard in plan.shards:
        count, row = 0, 0
        for n in shard.num_frames:
            for k in range(0, n, plan.temporal_patch_size):
                h, w = shard.imgs_sizes[row + k]
                count += output_tokens((h // plan.patch_dim, w // plan.patch_dim))
            row += n
        tokens.append(count)
    return tokens


@dataclass(frozen=True)
class WireBytes:
    forward: int
    backward: int


def mcore_gather_bytes(plan: Plan, width: int, itemsize: int) -> WireBytes:
    sent = (plan.cp_size - 1) * sum(local_tokens(plan)) * width * itemsize
    return WireBytes(sent, sent)


def reference_gather_bytes(plan: Plan, real: list[int], width: int, itemsize: int) -> WireBytes:
    cp = plan.cp_size
    forward = cp * (cp - 1) * max(real) * width * itemsize
    backward = 2 * (cp - 1) * sum(real) * width * itemsize  # ring all-reduce: 2 (CP-1)/CP per rank, CP ranks
    return WireBytes(forward, backward)


def wire_table(spec, cps, splits, itemsize: int = 2) -> str:
    """Markdown: per tower, CP and split, MiB on the wire for projected features vs the encoder output."""
    from vdpcp.feature.balance import plan_split
    from vdpcp.feature.sharded import real_tokens

    lines = [
        "| tower (hidden -> LM) | CP | split | gather | fwd projected MiB | fwd encoder-output MiB | projected / encoder | bwd projected MiB | bwd encoder-output MiB |",  # noqa: E501 (a markdown table row)
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, hidden, lm_hidden in TOWERS:
        for cp in cps:
            for split in splits:
                plan = plan_split(spec, cp, split)
                real = real_tokens(plan)
                gathers = (
                    ("mcore", [mcore_gather_bytes(plan, w, itemsize) for w in (lm_hidden, 4 * hidden)]),
                    ("reference", [reference_gather_bytes(plan, real, w, itemsize) for w in (lm_hidden, 4 * hidden)]),
                )
                for gather, (proj, enc) in gathers:
                    lines.append(
                        f"| {name} ({hidden} -> {lm_hidden}) | {cp} | {split} | {gather} | {proj.forward / MIB:.1f} "
                        f"| {enc.forward / MIB:.1f} | {proj.forward / enc.forward:.3f} "
                        f"| {proj.backward / MIB:.1f} | {enc.backward / MIB:.1f} |"
                    )
    return "\n".join(lines)


def add_arguments(parser) -> None:
    from vdpcp.cli import RANKS, SEED

    parser.add_argument("--dataset", default="multi-image", help="built-in generator (default multi-image)")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--cp", type=RANKS, action="append", help="CP sizes (repeatable; default 2 4 8)")


def run(args) -> int:
    from vdpcp.cli import UsageError
    from vdpcp.feature.balance import SPLIT_NAMES
    from vdpcp.feature.datasets import DATASETS, generate

    if args.dataset not in DATASETS:
        raise UsageError(f"--dataset must be one of {sorted(DATASETS)}, got {args.dataset!r}")
    cps = args.cp or [2, 4, 8]
    spec = generate(args.dataset, args.seed)
    print(f"{spec.name}: {len(spec.images)} images, {sum(spec.row_patches)} patches at P={spec.patch_dim}; bf16 (2 bytes)")
    print(wire_table(spec, cps, SPLIT_NAMES[:2]))
    return Exit.PASSED
