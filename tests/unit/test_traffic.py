"""vdpcp.oracle.observe.traffic counts the bytes of host pixels a rank copies to its device. On this CPU-only machine the device a
move names stands in for the accelerator: each move of the pixels, or of anything made of them on the host, is
counted once, and a rank past its share of the unsharded encode's own copies is not sharded."""

import pytest
import torch

from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.oracle.observe import traffic


def _pixels(rows: int = 10, width: int = 12) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.float32).reshape(1, rows, width)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_a_move_of_the_pixels_or_of_a_slice_is_counted_in_the_bytes_it_reads():
    pixels = _pixels()
    with traffic.Copies(pixels, "cpu") as copies:
        pixels.to("cpu")
        pixels[:, 2:5].to(device="cpu", non_blocking=True)
    assert copies.bytes == _bytes(pixels) + _bytes(pixels[:, 2:5])


def test_a_cast_on_the_host_is_no_copy_and_its_move_counts_the_cast_bytes():
    pixels = _pixels()
    with traffic.Copies(pixels, "cpu") as copies:
        cast = pixels.to(torch.float64)
        assert copies.bytes == 0
        cast.to("cpu", torch.float64)
    assert copies.bytes == _bytes(pixels.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_move_that_casts_in_the_same_call_counts_the_bytes_it_reads_on_the_host(dtype):
    """A loader's float32 pixels moved and cast at once (``.to(device, dtype)``, as a tower casting its input
    does): the host is read in float32, whatever the device receives."""
    pixels = _pixels()
    with traffic.Copies(pixels, "cpu") as copies:
        pixels.to("cpu", dtype)
        pixels[:, :4].to(device="cpu", dtype=dtype, non_blocking=True)
    assert copies.bytes == _bytes(pixels) + _bytes(pixels[:, :4])


def test_what_was_moved_is_on_the_device_so_moving_it_again_is_not_counted_twice():
    pixels = _pixels()
    with traffic.Copies(pixels, "cpu") as copies:
        moved = pixels.to("cpu")
        assert moved.data_ptr() != pixels.data_ptr() and torch.equal(moved, pixels)  # the stand-in's copy
        assert not copies.hosts(moved)
        moved.to("cpu")
        (moved * 2).to("cpu")
    assert copies.bytes == _bytes(pixels)


def test_a_tensor_made_of_the_pixels_on_the_host_is_host_memory_and_others_are_not():
    pixels, other = _pixels(), torch.ones(3, 4)
    with traffic.Copies(pixels, "cpu") as copies:
        placeholder = pixels.new_zeros(1, 1, pixels.shape[-1])  # built like the pixels: where they are
        joined = torch.cat([pixels[:, :1], placeholder], dim=1)
        assert copies.hosts(placeholder) and copies.hosts(joined) and not copies.hosts(other)
        other.to("cpu")
        joined.to(other)  # moved to match a device tensor: a copy
    assert copies.bytes == _bytes(joined)


def test_a_copy_into_a_device_buffer_is_counted():
    pixels = _pixels()
    with traffic.Copies(pixels, "cpu") as copies:
        buffer = torch.zeros(1, 4, pixels.shape[-1])  # a tensor of the device's, not made of the pixels
        buffer.copy_(pixels[:, :4])
    assert copies.bytes == _bytes(pixels[:, :4])


def test_an_empty_slice_holds_nothing_and_costs_nothing():
    pixels = _pixels()
    with traffic.Copies(pixels, "cpu") as copies:
        pixels[:, :0].to("cpu")
        torch.empty(0).to("cpu")
    assert copies.bytes == 0


def test_the_device_a_move_names_is_read_from_its_arguments():
    device = torch.device("cpu")
    assert traffic._named_device((), {"device": "cpu"}) == device
    assert traffic._named_device(("cpu", torch.float32), {}) == device
    assert traffic._named_device((torch.zeros(1),), {}) == device
    assert traffic._named_device((torch.float32,), {"non_blocking": True}) is None
    assert traffic._named_device((), {"dtype": torch.float64}) is None


def test_a_rank_may_copy_its_share_and_the_stated_slack_and_no_more():
    whole, patches = 64_000, 1000  # 64 bytes a patch
    assert traffic.allowed(whole, 500, patches) == 32_000 + 4_000  # an eighth of its share
    assert traffic.allowed(whole, 10, patches) == 640 + 16 * 64  # sixteen patches' worth
    assert traffic.allowed(whole, 0, patches) == 16 * 64


def test_the_verdict_names_the_rank_and_the_bytes_where_a_rank_moved_the_whole_microbatch():
    spec = MicrobatchSpec(images=((32, 32), (32, 32), (32, 32), (32, 32)))
    per_row = spec.row_patches[0] * 48 * 4
    whole = per_row * 4
    assert traffic.judge(per_row, whole, [1], spec, rank=1, cp=4) is None
    line = traffic.judge(whole, whole, [1], spec, rank=1, cp=4)
    assert line.startswith(f"not sharded: rank 1 copied {whole:,} bytes of host pixels to its device, 1x ")
    assert f"its tower read {spec.row_patches[0]} of {sum(spec.row_patches)} patches" in line
