"""vdpcp.feature.pixels hands a case's microbatch as its ``pixels`` axis says: in the tower's dtype, or as a data loader yields
them (float32, whatever the tower's dtype) with the metadata where the tower is; and it reads an implementation's
declaration of who moves them."""

import pytest
import torch

from vdpcp.feature import pixels
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import resolve
from vdpcp.impls.reference import Reference
from vdpcp.matrix.scenarios import matrix

SPEC = MicrobatchSpec(images=((16, 8), (8, 8)), name="two")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_loaders_pixels_are_float32_whatever_the_towers_dtype_and_the_metadata_are_unchanged(dtype):
    tower = pixels.handed(SPEC, "tower", dtype, "cpu")
    for host in (True, False):
        loaded = pixels.handed(SPEC, "loader", dtype, "cpu", host=host)
        assert tower.patches.dtype == dtype and loaded.patches.dtype == torch.float32
        assert torch.equal(loaded.cu_seqlens, tower.cu_seqlens) and torch.equal(loaded.imgs_sizes, tower.imgs_sizes)
        # the same image, as float32 holds it
        assert torch.allclose(loaded.patches.double(), tower.patches.double(), rtol=2 ** -7, atol=0)


def test_the_tower_sees_a_loaders_pixels_cast_to_its_dtype_on_its_device():
    loaded = pixels.handed(SPEC, "loader", torch.bfloat16, "cpu").patches
    seen = pixels.as_tower_sees(loaded, torch.bfloat16, "cpu")
    assert seen.dtype == torch.bfloat16 and torch.equal(seen, loaded.to(torch.bfloat16))


def test_a_fresh_copy_is_a_leaf_with_the_same_values_and_its_own_memory():
    loaded = pixels.handed(SPEC, "loader", torch.float64, "cpu").patches
    copy = pixels.fresh(loaded, requires_grad=True)
    assert copy.is_leaf and copy.requires_grad and torch.equal(copy, loaded) and copy.data_ptr() != loaded.data_ptr()


class _Declares:
    def __init__(self, value):
        self.loader_pixels = value


def test_who_moves_a_loaders_pixels_is_the_implementations_declaration_the_framework_by_default():
    assert pixels.loader_pixels(object()) == "device"
    assert pixels.moves_pixels(_Declares("host"), "loader") and not pixels.moves_pixels(_Declares("host"), "tower")
    assert not pixels.moves_pixels(object(), "loader") and not pixels.moves_pixels(_Declares(None), "loader")


class TowerDtypeOnly(Reference):
    """The reference, declaring that it takes pixels in its tower's dtype only."""

    name = "tower-dtype-only"
    loader_pixels = None


class DuckTowerDtypeOnly:
    """The same declaration on an object that is not an Implementation (vdpcp.contract.protocol.Adapted fills the rest)."""

    name = "duck-tower-dtype-only"
    loader_pixels = None

    def __init__(self):
        self._reference = Reference()

    def encode(self, model, inputs):
        return self._reference.encode(model, inputs)

    def encode_sharded(self, model, inputs, config, group):
        return self._reference.encode_sharded(model, inputs, config, group)


@pytest.mark.parametrize("declares", [TowerDtypeOnly, DuckTowerDtypeOnly])
def test_an_explicit_none_is_its_own_declaration_not_the_default_and_leaves_out_every_loader_case(declares):
    """None says the implementation takes pixels in its tower's dtype only: no loader case is run against it, where
    the same implementation without the declaration (the default, "device") gets its loader twins."""
    impl = resolve(f"{__name__}:{declares.__name__}")
    assert pixels.loader_pixels(_Declares(None)) is None and pixels.loader_pixels(impl) is None
    assert not any(case.pixels == "loader" for case in matrix(cps=(2,), impls=(f"{__name__}:{declares.__name__}",)))
    assert any(case.pixels == "loader" for case in matrix(cps=(2,), impls=("reference",)))


def test_only_pixels_on_the_host_of_an_accelerator_are_moved_by_a_rank():
    assert not pixels.on_host(torch.zeros(1), "cpu")  # host and device one memory
    assert pixels.on_host(torch.zeros(1), "cuda")
