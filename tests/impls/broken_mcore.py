"""MCore's adapter with one of the issue's planted bugs each, around MCore's own split and gather: the projector
run after the gather, and a rank holding only placeholders that skips its tower. Nobody registers them: tests and
scripts/mcore_mutant_kills.py select them by ``module:object`` target (``tests.impls.broken_mcore:skips_tower``).

Both are right in their outputs; what gives them away is in the gradients (each rank's own share, and which
layers ran), so on gloo they were seen only where MCore's gather backward ran there."""

from vdpcp.feature.model import output_tokens
from vdpcp.impls.mcore import MCore

PLACEHOLDER_TOKENS = output_tokens((1, 1))  # MCore's P x P placeholder: a 1x1 grid, padded to 2x2, one token


class GatherBeforeProject(MCore):
    """Gathers the tower's features, then every rank projects every image: the projector is replicated."""

    name = "mcore-gather-before-project"

    def encode_local(self, model, patches, imgs_sizes, num_frames, num_padded_ranks):
        from megatron.core.models.multimodal.context_parallel import gather_from_context_parallel_ranks_dynamic_res

        encoded = model.encode(patches, imgs_sizes, num_frames)
        return model.project(gather_from_context_parallel_ranks_dynamic_res(encoded, num_padded_ranks))


class SkipsTower(MCore):
    """A rank whose share is only MCore's placeholders hands the gather zeros of their shape instead of running its
    tower (still in backward, so it enters every collective of the gather): in training a TP or FSDP peer of it
    would hang."""

    name = "mcore-skips-tower"

    def encode_local(self, model, patches, imgs_sizes, num_frames, num_padded_ranks):
        from megatron.core import parallel_state as ps

        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        if rank < cp - num_padded_ranks:
            return super().encode_local(model, patches, imgs_sizes, num_frames, num_padded_ranks)
        from megatron.core.models.multimodal.context_parallel import gather_from_context_parallel_ranks_dynamic_res

        skipped = patches.new_zeros(PLACEHOLDER_TOKENS * len(imgs_sizes), model.config.lm_hidden, requires_grad=True)
        return gather_from_context_parallel_ranks_dynamic_res(skipped, num_padded_ranks)


gather_before_project = GatherBeforeProject()
skips_tower = SkipsTower()
