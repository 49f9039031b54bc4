"""Capture: turn the vision inputs of one training microbatch into a spec file that replays anywhere.

Whether a microbatch trips the placeholder path depends only on its shapes and the CP size, never on its
pixels, so a spec (sizes, frames, tubelet size, patch size, seed) is enough to reproduce it: the spec
makes deterministic tensors of the same shapes. Call ``capture`` where the model hands its images to the
vision encoder; tensors and lists are both accepted::

    from vdpcp.tools.capture import capture_on_failure

    # around the vision encoder, in the training step
    with capture_on_failure(f"crashes/step{step}-rank{rank}.json", imgs_sizes, cp=cp_size,
                            patch_dim=16, num_frames=num_frames, temporal_patch_size=tps, seed=step):
        features = model.encode_images(images, imgs_sizes, num_frames)

    # later, on a laptop (gloo):  vdpcp replay crashes/step18412-rank3.json

Only the ranks that raise write a file, and every CP rank holds the same microbatch, so any one file is
the whole story. A microbatch whose replay would need more memory than the spec limit allows (vdpcp.matrix.budget:
--max-spec-bytes / VDPCP_MAX_SPEC_BYTES, 8 GiB by default) is refused at the capture call, before the block runs,
as any other bad capture is. The spec has no CP field: the CP size travels in its name as a trailing ``-cp<N>`` tag,
which ``vdpcp replay`` reads (``cp_from_name``) unless ``--cp`` is given.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from vdpcp.feature.spec import MicrobatchSpec, SpecError, clipped
from vdpcp.matrix import budget
from vdpcp.matrix.case import Case
from vdpcp.matrix.saved import cp_from_name, name_with_cp


def capture(
    imgs_sizes,
    *,
    cp: int,
    patch_dim: int,
    num_frames=None,
    temporal_patch_size: int = 1,
    seed: int = 0,
    name: str = "captured",
) -> MicrobatchSpec:
    """The spec of a microbatch: ``imgs_sizes`` [N, 2] (H, W) per image or frame, ``num_frames`` per media item.

    Raises SpecError (naming the field) when the inputs do not describe a valid microbatch, SpecTooLarge when
    replaying it (float64, the reference, at ``cp``) would need more than the spec limit.
    """
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise SpecError(f"capture: cp must be a positive integer, got {cp!r}")
    sizes = _as_list(imgs_sizes, "imgs_sizes")
    if not all(isinstance(s, list) and len(s) == 2 for s in sizes):
        raise SpecError(f"capture: field 'imgs_sizes' must hold one (H, W) pair per image, got {clipped(sizes)}")
    frames = None if num_frames is None else _as_list(num_frames, "num_frames")
    spec = MicrobatchSpec.from_dict(
        {
            "name": name_with_cp(name, cp),
            "images": sizes,
            **({"num_frames": frames} if frames is not None else {}),
            "temporal_patch_size": int(temporal_patch_size),
            "patch_dim": int(patch_dim),
            "seed": int(seed),
        },
        source="capture",
    )
    budget.check(Case(spec, cp), "capture")
    return spec


@contextmanager
def capture_on_failure(path: str | Path, imgs_sizes, **fields):
    """Run the block; if it raises, save the microbatch's spec to ``path`` and re-raise.

    ``fields`` are ``capture``'s keywords. The spec is built before the block runs, so a bad capture call
    (a ``path`` whose ``-cp<N>`` tag is not ``cp``, a file replay would reject, among them) fails at once
    instead of masking the training error later.
    """
    spec = capture(imgs_sizes, **fields)
    tagged = cp_from_name(Path(path).stem)
    if tagged is not None and tagged != fields["cp"]:
        raise SpecError(f"capture: {path}: the file name (tag -cp{tagged}) and cp={fields['cp']} disagree; "
                        f"expected one CP size")
    try:
        yield spec
    except BaseException:
        spec.save(path)
        raise


def _as_list(value, field: str) -> list:
    """Tensors (any device), numpy arrays and sequences of them, as plain nested lists."""
    value = _plain(value)
    if not isinstance(value, list):
        raise SpecError(f"capture: field '{field}' must be a tensor or a list, got {type(value).__name__}")
    return value


def _plain(value):
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value
