"""Megatron-Bridge's released Qwen3-VL vision section, plugged into vdpcp as a Bridge engineer would plug it in.

Bridge's ``Qwen3VLModel.forward`` runs its vision section (``reorganize_inputs``; at CP > 1 with
``vision_dp_when_cp``, ``qwen3vl_cp_split``, ``get_vision_cp_data`` and ``collapse_thw``; the tower on this rank's
share, or the empty embeddings of a rank with none; ``ensure_requires_grad_for_cp_collective``;
``AllGatherVisionEmbeddings.apply`` on the features and on every DeepStack level), then merges the gathered features
into its text embeddings. This plug-in runs that section line for line on the model vdpcp.impls.bridge_qwen3_vl
builds, every function the installed release's own, unchanged, and returns the gathered features and DeepStack
levels as the protocol asks: no merge of Bridge's, no copy of anything. Bridge's merge (an index assignment) copies
the features, so inside Bridge's whole forward its gather's backward, which all-reduces the gradient it is handed in
place, is harmless; returned as they are, vdpcp's additive merge reads that gradient after the write.

Nobody registers it: tests select it by its ``module:object`` target (``tests.impls.bridge_qwen3_vl_section:section``,
and ``:section_merges_copy``, the same section declaring that its model's merges copy).
"""

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import MAIN_OUTPUT, check_group
from vdpcp.impls.bridge_qwen3_vl import ONE_RANK, UTILS, BridgeQwen3VL, forward_arguments


class Section(BridgeQwen3VL):
    """The vision section of the installed release's ``Qwen3VLModel.forward``, on ``model``'s own parts."""

    def encode(self, model, inputs):
        return self._section(model, inputs, ONE_RANK, vision_dp_when_cp=False)

    def encode_sharded(self, model, inputs, config, group):
        if group is not None or config.shard_vision:  # Bridge's set-up builds its CP group from the config
            check_group(config, dist.get_world_size(group), self.name)
        cp_group = group if config.shard_vision else ONE_RANK  # a configured CP of 1: Bridge's group is one rank
        return self._section(model, inputs, cp_group, vision_dp_when_cp=config.vision_dp_over_cp)

    def _section(self, model, inputs, cp_group, vision_dp_when_cp: bool) -> dict[str, torch.Tensor]:
        args = forward_arguments(inputs, cp_group.size())
        model.config.vision_dp_when_cp = vision_dp_when_cp
        utils = self.release()[UTILS]
        with self.release().running():
            embeds, levels = vision_section(model, utils, cp_group, **args)
        if embeds is None:  # no image or video: nothing went through the section
            embeds = torch.zeros((0, model.config.hidden_size), dtype=model.config.params_dtype,
                                 device=args["input_ids"].device)
            levels = [embeds] * len(model.vision_transformer_config.deepstack_visual_indexes)
        return {MAIN_OUTPUT: embeds, **{f"deepstack{k}": level for k, level in enumerate(levels)}}


def vision_section(self, utils, cp_group, input_ids, pixel_values=None, pixel_values_videos=None,
                   image_grid_thw=None, video_grid_thw=None):
    """The vision section of Bridge's ``Qwen3VLModel.forward`` as the release writes it, ``self`` the model, its
    process group ``cp_group`` (``self.pg_collection.cp`` there); returns (the gathered features, DeepStack levels)."""
    cp_rank, cp_size = cp_group.rank(), cp_group.size()
    cp_img_num = images_padded = None
    deepstack_feature_lists = None
    vision_data, vision_grid_thw, vision_mask = utils.reorganize_inputs(
        input_ids=input_ids,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        image_input_mask=None,
        video_input_mask=None,
        image_token_id=self.image_token_id,
        video_token_id=self.video_token_id,
        square_merge_size=self.square_merge_size,
    )

    vision_embeds = None

    if vision_grid_thw is not None and vision_grid_thw.shape[0] > 0:
        if cp_size > 1 and self.config.vision_dp_when_cp:
            if cp_img_num is None:
                assert images_padded is None
                vision_data, vision_grid_thw, cp_img_num, images_padded = utils.qwen3vl_cp_split(
                    cp_size,
                    vision_data,
                    vision_grid_thw,
                )
            vision_data, vision_grid_thw, seqlen_on_cp_ranks = utils.get_vision_cp_data(
                vision_data,
                vision_grid_thw,
                self.square_merge_size,
                cp_img_num,
                images_padded,
                cp_rank,
                cp_size,
            )
            vision_grid_thw = utils.collapse_thw(vision_grid_thw)
        if vision_data.shape[0] > 0:
            vision_embeds, deepstack_feature_lists = self.vision_model(
                hidden_states=vision_data,
                grid_thw=vision_grid_thw,
            )
        else:
            vision_embeds = torch.zeros(
                (0, self.config.hidden_size),
                device=vision_data.device,
                dtype=self.config.params_dtype,
            )
            deepstack_feature_lists = []
            for _ in self.vision_transformer_config.deepstack_visual_indexes:
                deepstack_feature_lists.append(
                    torch.zeros(
                        (0, self.language_model.config.hidden_size),
                        device=vision_data.device,
                        dtype=self.config.params_dtype,
                    )
                )
        if cp_size > 1 and self.config.vision_dp_when_cp:
            utils.ensure_requires_grad_for_cp_collective((vision_embeds, *deepstack_feature_lists))
            vision_embeds = utils.AllGatherVisionEmbeddings.apply(
                vision_embeds,
                seqlen_on_cp_ranks,
                cp_group,
            )
            for i in range(len(deepstack_feature_lists)):
                deepstack_feature_lists[i] = utils.AllGatherVisionEmbeddings.apply(
                    deepstack_feature_lists[i],
                    seqlen_on_cp_ranks,
                    cp_group,
                )
    return vision_embeds, deepstack_feature_lists


class SectionMergesCopy(Section):
    """The same section, in a model whose merges copy the gathered features (Bridge's index assignment does)."""

    merges_copy = True


section = Section("bridge-qwen3-vl-section")
section_merges_copy = SectionMergesCopy("bridge-qwen3-vl-section-merges-copy")
