"""The Bridge adapter (vdpcp.impls.bridge.BridgeEncoder) lends the model the CP group for one call only, and takes it
back however the call ends: a mismatch case raises inside Bridge's ``_encode_images``, and the model goes back to
the rank's cache (vdpcp.oracle.model_cache) for the next case, which copies it for the exact run below float64; a live
ProcessGroup left on it cannot be copied.

In one process: the model is a stand-in with Bridge's switches and ``_encode_images`` (it raises the mismatch as
Nemotron Omni's does, before any collective), the CP group a stand-in that refuses to be copied as a live group
does. The adapter itself is what runs."""

import copy
from types import SimpleNamespace

import pytest
import torch

from vdpcp.contract.protocol import VisionDPConfig
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import bridge

SPEC = MicrobatchSpec(images=((16, 16), (16, 8), (8, 16)), name="three")


class LiveGroup:
    """A CP group of two ranks that cannot be copied, as torch's ProcessGroup cannot."""

    def size(self) -> int:
        return 2

    def __deepcopy__(self, memo):
        raise TypeError("cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")


class Alone:
    """The model's own group before any case: itself alone, copyable."""

    def size(self) -> int:
        return 1


class BridgeModel(torch.nn.Module):
    """Bridge's switches and ``_encode_images``: with the flag on, the configured CP must be its group's size."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(48, 4, dtype=torch.float64)
        self.vision_dp_over_cp, self.context_parallel_lm = False, 1
        self.pg_collection = SimpleNamespace(cp=Alone())
        self.sizes_seen = []  # the CP group's size in each call

    def _encode_images(self, images, imgs_sizes, packed_seq_params, num_frames):
        self.sizes_seen.append(self.pg_collection.cp.size())
        if self.vision_dp_over_cp and self.pg_collection.cp.size() != self.context_parallel_lm:
            raise ValueError(f"vision_dp_over_cp does not match its process group: config={self.context_parallel_lm}, "
                             f"group={self.pg_collection.cp.size()}.")
        return self.proj(images[0])


@pytest.fixture
def lent(monkeypatch):
    """The group the adapter lends the model: a LiveGroup (no process group is set up in this process). MCore's
    packed-sequence description is left out too (the stand-in reads none; importing megatron-core costs seconds)."""
    group = LiveGroup()
    monkeypatch.setattr(bridge, "mcore_context_parallel_group", lambda handed, name: group)
    monkeypatch.setattr(bridge, "packed_seq_params", lambda cu_seqlens: None)
    return group


@pytest.mark.parametrize("configured", [2, 4], ids=["returns", "raises-the-mismatch"])
def test_the_model_gets_its_own_group_back_however_the_call_ends(lent, configured):
    model = BridgeModel()
    own = model.pg_collection.cp
    batch = SPEC.tensors(dtype=torch.float64)
    config = VisionDPConfig(vision_dp_over_cp=True, context_parallel_size=configured)
    if configured == lent.size():
        assert bridge.BridgeEncoder().encode_sharded(model, batch, config, group=None).shape[-1] == 4
    else:
        with pytest.raises(ValueError, match="does not match its process group"):
            bridge.BridgeEncoder().encode_sharded(model, batch, config, group=None)
    assert model.sizes_seen == [lent.size()]  # the call had the CP group
    assert model.pg_collection.cp is own, model.pg_collection.cp
    copy.deepcopy(model)  # the next case's exact run copies it
