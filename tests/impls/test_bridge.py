"""The Bridge adapter (vdpcp.impls.bridge): it calls Bridge's ``_encode_images`` only where the microbatch has
media, as Bridge's forward does, and otherwise returns what that forward has, no vision features ([0, the projector's
output width], in its dtype, no graph), or one error naming what the model lacks to say that width; and it leaves
nothing of a case on the model: a model reused for the next case (the rank's cache, vdpcp.oracle.model_cache) is copied for
the exact run below float64, and a ProcessGroup left on it cannot be copied (measured on the H200: every
nemotron-omni case after the first on a worker errored)."""

import pytest
import torch
from torch import nn

from vdpcp.contract.protocol import VisionDPConfig
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls.bridge import BridgeEncoder
from vdpcp.impls.nemotron_omni import SIZES, Projection
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged

P = SIZES["toy"].patch
SPEC = MicrobatchSpec(((4 * P, 4 * P), (2 * P, 4 * P), (4 * P, 2 * P)), patch_dim=P, seed=2, name="three-even")
EMPTY = MicrobatchSpec((), patch_dim=P)


class Encoder(nn.Module):
    """Bridge's ``_encode_images`` and flag, and a vision_projection of its own: records each call."""

    def __init__(self, *projections: nn.Module):
        super().__init__()
        self.vision_dp_over_cp, self.calls = False, []
        if projections:
            self.vision_projection = projections[0] if len(projections) == 1 else nn.Sequential(*projections)

    def _encode_images(self, images, imgs_sizes, packed_seq_params, num_frames):
        self.calls.append(imgs_sizes.shape[0])
        return images[0, :, :2]


def _arms(module, spec):
    """The adapter's unsharded encode, and its sharded one with the feature off (no process group needed)."""
    adapter, batch = BridgeEncoder(), spec.tensors()
    return [adapter.encode(module, batch), adapter.encode_sharded(module, batch, VisionDPConfig(1), None)]


def test_a_microbatch_without_media_is_not_encoded_and_has_no_vision_features():
    module = Encoder(Projection(SIZES["toy"]).to(torch.float64))  # MCore's projector, as Omni's is
    for out in _arms(module, EMPTY):
        assert out.shape == (0, SIZES["toy"].lm_hidden) and out.dtype == torch.float64 and out.device.type == "cpu"
        assert out.grad_fn is None and not out.requires_grad
    assert module.calls == []


def test_a_microbatch_with_media_is_encoded_by_bridges_encoder():
    module = Encoder()  # the projector's width is read only where nothing is encoded
    batch = SPEC.tensors()
    assert [torch.equal(out, batch.patches[0, :, :2]) for out in _arms(module, SPEC)] == [True, True]
    assert module.calls == [3, 3]


@pytest.mark.parametrize(("projections", "held"), [
    ((), "no vision_projection module"),
    ((nn.Linear(4, 8),), "0 MCore MultimodalProjectors with parameters in its vision_projection"),
    ((Projection(SIZES["toy"]), Projection(SIZES["toy"])), "2 MCore MultimodalProjectors with parameters"),
], ids=["none", "no-mcore-projector", "two"])
def test_without_one_mcore_projector_an_empty_microbatch_says_what_the_model_lacks(projections, held):
    with pytest.raises(ValueError, match=f"the config.hidden_size of the one MCore MultimodalProjector in the model's "
                                         f"vision_projection; Encoder has {held}"):
        _arms(Encoder(*projections), EMPTY)


@pytest.mark.parametrize("loss", ["rank", "zigzag"])  # the second runs on the model the first left in the cache
def test_a_bf16_case_passes_on_the_model_the_case_before_it_used(loss):
    judged = run_judged(Case(SPEC, 2, "nemotron-omni", loss=loss, dtype="bfloat16"), backend="gloo")
    assert judged.verdict == "pass", judged.result.summary()
