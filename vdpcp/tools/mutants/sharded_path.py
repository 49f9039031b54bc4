"""Named bugs of vdpcp's own sharded path (plan, split, gather, model and loss, groups and TP), as monkeypatches.

Each is a plausible bug the matrix must catch, written as replacements of vdpcp's own module attributes (never
MCore's), built inside the rank. They apply to the reference; a bug at the interface, for any implementation,
lives in vdpcp.tools.mutants.interface.
"""

from __future__ import annotations

from vdpcp.tools.mutants.registry import mutant

# --- the gather, the first two bugs written (MUTANTS keeps this file's order) ---------------------------


@mutant(
    "grad-not-summed",
    "the gather's backward keeps only this rank's own gradient instead of summing over ranks",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count-zigzag"),
)
def _grad_not_summed():
    import torch.distributed as dist

    from vdpcp.feature import comm

    class NoSum(comm._GatherFeatures):
        @staticmethod
        def backward(ctx, grad):
            return comm._own_rows(ctx, grad), None, None

    def gather(local, counts, group=None):
        assert len(counts) == dist.get_world_size(group)
        return NoSum.apply(local, list(counts), group)

    return {"vdpcp.feature.sharded:gather_features": gather}


@mutant(
    "placeholder-drop-mismatch",
    "the gather drops one placeholder output fewer than the plan injected, so a placeholder's features reach the language model",
    kills=("one-image-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _placeholder_drop_mismatch():
    from vdpcp.feature import sharded
    from vdpcp.feature.model import output_tokens

    real_tokens = sharded.real_tokens

    def kept_tokens(plan):
        counts = real_tokens(plan)
        if plan.num_placeholders:  # placeholders sit at the end, on the last rank: keep one of them
            counts[-1] += output_tokens((1, 1))
        return counts

    return {"vdpcp.feature.sharded:real_tokens": kept_tokens}


# --- the plan ----------------------------------------------------------------------------------------


@mutant(
    "remainder-on-first-rank",
    "the count split gives the remainder to the first rank instead of the last, so the report and the checks "
    "disagree with what MCore's split really assigned",
    kills=("remainder-even-tokens-cp4-mcore-count", "remainder-even-tokens-cp2-mcore-count"),
)
def _remainder_on_first_rank():
    from vdpcp.feature import plan

    def first_takes_remainder(media, cp, T):
        points, media, padded, placeholders = original(media, cp, T)
        starts = [first for first, _ in plan._units(media[: len(media) - placeholders], T)]
        starts += [sum(media) - placeholders + i for i in range(placeholders)]
        per_rank, extra = divmod(len(starts), cp)
        return [0] + [starts[extra + r * per_rank] for r in range(1, cp)] + [points[-1]], media, padded, placeholders

    original = plan._unit_count_split
    return {"vdpcp.feature.plan:_unit_count_split": first_takes_remainder}


@mutant(
    "zero-image-rank",
    "no placeholders are injected, so with fewer images than ranks some ranks are left with nothing to encode",
    kills=("three-images-cp4-reference-count", "one-image-cp2-reference-count"),
)
def _zero_image_rank():
    from vdpcp.feature import plan

    def no_placeholders(media, cp, T):
        starts = [first for first, _ in plan._units(media, T)]
        total = sum(media)
        per_rank = len(starts) // cp  # 0 with fewer units than ranks: every rank but the last gets none
        points = [starts[r * per_rank] if r * per_rank < len(starts) else total for r in range(cp)] + [total]
        return points, media, 0, 0

    return {"vdpcp.feature.plan:_unit_count_split": no_placeholders}


@mutant(
    "tubelet-split-mid-tubelet",
    "split points are put at the even frame split without moving them onto a tubelet boundary, so a tubelet "
    "is cut between two ranks",
    kills=("video-t2-even-cp2-reference-count", "video-t4-ragged-cp2-reference-count"),
)
def _tubelet_split_mid_tubelet():
    def even_frame_points(media, T, cp, total):
        return [int(r * total / cp) for r in range(cp)] + [total]

    return {"vdpcp.feature.plan:_tubelet_split_points": even_frame_points}


# --- the split -----------------------------------------------------------------------------------------


@mutant(
    "cu-seqlens-not-rewritten",
    "the rank slices its patches with the microbatch's global cu_seqlens as if they were its own local ones, "
    "so every rank reads the first images' patches",
    kills=("eight-equal-cp2-reference-count", "eleven-images-cp2-reference-count"),
)
def _cu_seqlens_not_rewritten():
    from vdpcp.feature import sharded

    def split(batch, shard, order=None):
        stop = int(batch.cu_seqlens[shard.num_real_rows])  # local row count, global offsets: starts at image 0
        local = batch.patches[:, :stop]
        if shard.num_placeholders:
            zeros = batch.patches.new_zeros(1, shard.num_placeholders, batch.patches.shape[-1])
            local = sharded.torch.cat([local, zeros], dim=1)
        return local

    return {"vdpcp.feature.sharded:split": split}


@mutant(
    "imgs-sizes-not-rewritten",
    "the rank encodes its own patches with the first rows of the global imgs_sizes instead of its own",
    kills=("non-square-cp2-reference-count", "mixed-sizes-cp2-reference-count"),
)
def _imgs_sizes_not_rewritten():
    from dataclasses import replace

    from vdpcp.feature import plan

    def make_shard(rank, start, stop, rows, media, num_real, patch_dim):
        shard = original(rank, start, stop, rows, media, num_real, patch_dim)
        return replace(shard, imgs_sizes=tuple(rows[: stop - start]))

    original = plan._make_shard
    return {"vdpcp.feature.plan:_make_shard": make_shard}


# --- the gather ----------------------------------------------------------------------------------------


@mutant(
    "placeholders-not-dropped",
    "the gather keeps every placeholder's output, so placeholder features reach the language model",
    kills=("three-images-cp4-reference-count", "one-image-cp2-reference-count"),
)
def _placeholders_not_dropped():
    from vdpcp.feature import sharded
    from vdpcp.feature.model import output_tokens

    real_tokens = sharded.real_tokens

    def all_tokens(plan):
        return [n + output_tokens((1, 1)) * s.num_placeholders for n, s in zip(real_tokens(plan), plan.shards)]

    return {"vdpcp.feature.sharded:real_tokens": all_tokens}


@mutant(
    "placeholders-dropped-from-front",
    "the gather drops the placeholder ranks' outputs from the wrong end: the first num_padded_ranks ranks' "
    "instead of the last",
    kills=("three-images-cp4-reference-count", "one-image-cp2-reference-count"),
)
def _placeholders_dropped_from_front():
    import torch
    import torch.distributed as dist

    from vdpcp.feature import comm

    def gather(local, counts, group=None):
        padded = sum(1 for n in counts if n == 0)  # the ranks that hold only placeholders
        rows = torch.tensor([local.shape[0]])
        every = [torch.zeros_like(rows) for _ in counts]
        dist.all_gather(every, rows, group=group)
        full = [int(n) for n in every]
        return comm.gather_features(local, full, group)[sum(full[:padded]):]

    return {"vdpcp.feature.sharded:gather_features": gather}


@mutant(
    "shards-gathered-out-of-order",
    "the gather concatenates the ranks' shards in reverse rank order",
    kills=("eight-equal-cp2-reference-count", "eleven-images-cp4-reference-count"),
)
def _shards_gathered_out_of_order():
    import torch

    from vdpcp.feature import comm

    def gather(local, counts, group=None):
        gathered = comm.gather_features(local, counts, group)
        return torch.cat(list(gathered.split(list(counts)))[::-1])

    return {"vdpcp.feature.sharded:gather_features": gather}


@mutant(
    "grad-averaged",
    "the gather's backward averages the ranks' gradients (a data-parallel habit) instead of summing them",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count-zigzag"),
)
def _grad_averaged():
    import torch.distributed as dist

    from vdpcp.feature import comm

    class Averaged(comm._GatherFeatures):
        @staticmethod
        def backward(ctx, grad):
            local_grad, _, _ = comm._GatherFeatures.backward(ctx, grad)
            return local_grad / dist.get_world_size(ctx.group), None, None

    def gather(local, counts, group=None):
        return Averaged.apply(local, list(counts), group)

    return {"vdpcp.feature.sharded:gather_features": gather}


@mutant(
    "gather-order-not-restored",
    "under the packed split, whose ranks hold images out of order, the gathered features are not put back in "
    "image order, so each image's tokens reach another image's place in the sequence",
    kills=("eleven-images-cp2-reference-packed", "multi-image-cp4-reference-packed"),
)
def _gather_order_not_restored():
    return {"vdpcp.feature.sharded:image_order": lambda plan: None}


@mutant(
    "gather-before-project",
    "the encoder output is gathered before the projector, so every rank projects every image (the projector "
    "is replicated and a wider tensor crosses the wire)",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _gather_before_project():
    import torch.distributed as dist

    from vdpcp.feature import sharded

    def encode_sharded(model, batch, config, group=None):
        if not config.shard_vision:
            return original(model, batch, config, group)
        plan = sharded.plan_for(batch.spec, config)
        shard = plan.shard(dist.get_rank(group))
        encoded = model.encode(sharded.split(batch, shard), shard.imgs_sizes, shard.num_frames)
        return model.project(sharded.gather_features(encoded, sharded.real_tokens(plan), group))

    original = sharded.encode_sharded
    return {"vdpcp.feature.sharded:encode_sharded": encode_sharded}


# --- the model and the loss ----------------------------------------------------------------------------


@mutant(
    "even-grid-padding-skipped",
    "odd patch grids are not zero-padded to even before the pixel shuffle, so the 1x1 placeholders crash it",
    kills=("empty-cp2-reference-count", "one-image-cp2-reference-count"),
)
def _even_grid_padding_skipped():
    return {"vdpcp.feature.model:pad_patch_grid_to_even": lambda grid: grid}


@mutant(
    "replicated-loss",
    "every CP rank's loss covers all the gathered rows instead of its own share, so the summed gradients "
    "count each row CP times",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _replicated_loss():
    from vdpcp.feature import loss

    def rank_loss(outputs, case_loss, prompt, rank):
        return loss.merged_loss(outputs, prompt, case_loss.stream_weights())

    return {"vdpcp.feature.loss:rank_loss": rank_loss}


# --- groups and ranks (parallel layouts, execution, rank-asymmetric bugs) -----------------------------


@mutant(
    "gather-on-default-group",
    "the gather runs on the default process group instead of the CP group it was handed, so with data "
    "parallelism around CP every rank gathers every replica's features",
    kills=("eleven-images-cp2-dp2-reference-count", "three-images-cp2-dp2-reference-count"),
)
def _gather_on_default_group():
    from vdpcp.feature import comm

    def gather(local, counts, group=None):
        import torch.distributed as dist

        everyone = counts * (dist.get_world_size() // len(counts))  # what a default-group gather would collect
        return comm.gather_features(local, everyone, None)

    return {"vdpcp.feature.sharded:gather_features": gather}


def _skipping_placeholder_ranks(skips, width=lambda model: model.config.lm_hidden):
    """encode_sharded in which a rank holding only placeholders, where ``skips(model)`` says so, never runs its
    tower: it hands the gather zeros of the placeholders' shape, ``width(model)`` wide (still in backward, so every
    collective of the gather is entered), as a rank that 'has nothing real to encode' would."""
    import torch.distributed as dist

    from vdpcp.feature import sharded
    from vdpcp.feature.model import output_tokens

    original = sharded.encode_sharded

    def encode_sharded(model, batch, config, group=None):
        if not config.shard_vision or not skips(model):
            return original(model, batch, config, group)
        plan = sharded.plan_for(batch.spec, config)
        shard = plan.shard(dist.get_rank(group))
        if shard.num_real_rows > 0:
            return original(model, batch, config, group)
        tokens = output_tokens((1, 1)) * shard.num_placeholders
        skipped = batch.patches.new_zeros(tokens, width(model), requires_grad=True)
        gathered = sharded.gather_features(skipped, sharded.real_tokens(plan), group)
        index = sharded.image_order(plan)
        return gathered if index is None else gathered[index]

    return {"vdpcp.feature.sharded:encode_sharded": encode_sharded}


@mutant(
    "placeholder-rank-skips-tower",
    "a rank that holds only placeholders skips the tower and hands the gather zeros of the right shape: outputs "
    "and gradients still match (the gather drops placeholders), but in real training that rank never enters "
    "the collectives of a tensor-parallel or FSDP-sharded tower and its peers hang",
    kills=("three-images-cp4-reference-count", "one-image-cp2-reference-count"),
)
def _placeholder_rank_skips_tower():
    return _skipping_placeholder_ranks(lambda model: True)


@mutant(
    "tp-peer-skips-placeholder-tower",
    "with a tensor-parallel tower, the second TP rank of a rank that holds only placeholders skips the tower "
    "(its first TP rank encodes them): that first rank waits in the tower's TP all-reduce for a peer that never "
    "comes, the hang seen in real training, which vdpcp must report naming the missing rank, not hang on",
    kills=("three-images-cp4-tp2-reference-count",),
)
def _tp_peer_skips_placeholder_tower():
    import torch.distributed as dist

    from vdpcp.feature.tensor_parallel import ParallelMLP

    def second_tp_rank(model) -> bool:
        mlp = model.blocks[0].mlp
        return isinstance(mlp, ParallelMLP) and dist.get_rank(mlp.group) > 0

    return _skipping_placeholder_ranks(second_tp_rank)


@mutant(
    "tp-backward-not-reduced",
    "the tensor-parallel MLP's backward hands each TP rank its own partial input gradient, never all-reduced over "
    "the TP group (a forgotten copy-to-TP region): outputs are right, input and upstream gradients are not",
    kills=("three-images-cp2-tp2-reference-count",),
)
def _tp_backward_not_reduced():
    from vdpcp.feature import tensor_parallel

    class NotReduced(tensor_parallel._CopyToTP):
        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    return {"vdpcp.feature.tensor_parallel:_CopyToTP": NotReduced}


@mutant(
    "tp-forward-not-reduced",
    "the tensor-parallel MLP's row-parallel layer returns this TP rank's partial output without the all-reduce "
    "(a forgotten reduce-from-TP region): every TP rank's features are wrong, and wrong differently",
    kills=("three-images-cp2-tp2-reference-count",),
)
def _tp_forward_not_reduced():
    from vdpcp.feature import tensor_parallel

    class NotReduced(tensor_parallel._ReduceFromTP):
        @staticmethod
        def forward(ctx, x, group, what):
            return x.view_as(x)

    return {"vdpcp.feature.tensor_parallel:_ReduceFromTP": NotReduced}


@mutant(
    "backward-reduces-to-rank-0",
    "the gather's backward reduces the gradient to rank 0 instead of all-reducing it, so every other rank's "
    "images miss the gradient their features got on other ranks",
    kills=("eleven-images-cp2-reference-count", "three-images-cp4-reference-count-zigzag"),
)
def _backward_reduces_to_rank_0():
    import torch.distributed as dist

    from vdpcp.feature import comm

    class ReducedToRank0(comm._GatherFeatures):
        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.reduce(grad, dst=dist.get_global_rank(ctx.group, 0) if ctx.group is not None else 0, group=ctx.group)
            return comm._own_rows(ctx, grad), None, None

    def gather(local, counts, group=None):
        return ReducedToRank0.apply(local, list(counts), group)

    return {"vdpcp.feature.sharded:gather_features": gather}


@mutant(
    "placeholder-rank-guesses-width",
    "a rank that holds only placeholders skips the tower and guesses its output width as the tower's hidden size, "
    "not the projector's: it gathers a tensor of another shape than its peers' (the empty rank's guessed hidden size)",
    kills=("one-image-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _placeholder_rank_guesses_width():
    return _skipping_placeholder_ranks(lambda model: True, width=lambda model: model.config.hidden)


@mutant(
    "placeholder-dtype-hard-coded",
    "a rank that holds only placeholders hands the gather its features in a dtype written into the code (float16 "
    "here; the field's was bf16, wrong in every dtype but its own): the ranks' gather meets another dtype on that rank",
    kills=("one-image-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _placeholder_dtype_hard_coded():
    import torch
    import torch.distributed as dist

    from vdpcp.feature import sharded

    original = sharded.gather_features

    def gather_features(local, counts, group=None):  # float16: no case of vdpcp's runs in it, so wrong in every one
        only_placeholders = counts[dist.get_rank(group)] == 0
        return original(local.to(torch.float16) if only_placeholders else local, counts, group)

    return {"vdpcp.feature.sharded:gather_features": gather_features}


# --- the partition's balance (correct outputs and gradients: only a rank's load shows them) --------------


@mutant(
    "balanced-cut-one-unit-late",
    "the contiguous balanced split's first cut falls one unit after the optimal one (an off-by-one at the cut "
    "index): rank 0 carries a unit it need not, every output and gradient still right",
    kills=("video-t2-ragged-cp2-reference-balanced", "video-and-images-cp4-reference-balanced"),
)
def _balanced_cut_one_unit_late():
    from vdpcp.feature import plan

    original = plan._balanced_split

    def split(rows, media, cp, T, patch_dim, unit_cost):
        points, media, padded, placeholders = original(rows, media, cp, T, patch_dim, unit_cost)
        inside = [first for first, _ in plan._units(media, T) if points[1] < first < points[2]]
        if not placeholders and inside:  # rank 1 keeps at least one unit: the plan stays a plan
            points = [points[0], inside[0], *points[2:]]
        return points, media, padded, placeholders

    return {"vdpcp.feature.plan:_balanced_split": split}


@mutant(
    "split-cost-squared",
    "the balanced and packed splits weigh each unit by the square of the cost the config declares (a cost model "
    "that is not the work): small units heap onto few ranks, every output and gradient still right",
    kills=("eleven-images-cp2-reference-packed", "eleven-images-cp4-reference-balanced"),
)
def _split_cost_squared():
    from vdpcp.feature import plan

    balanced, packed = plan._balanced_split, plan._packed_split

    def squared(cost):
        return lambda tokens: cost(tokens) ** 2

    return {"vdpcp.feature.plan:_balanced_split": lambda *a: balanced(*a[:5], squared(a[5])),
            "vdpcp.feature.plan:_packed_split": lambda *a: packed(*a[:5], squared(a[5]))}
