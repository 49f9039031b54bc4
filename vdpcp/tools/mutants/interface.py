"""Generic mutants: bugs at the interface, for ANY implementation, as wrappers around it (``@generic``).

Each wraps an implementation's ``encode_sharded`` and changes what it returns (``Wrapped(impl, change)``) or how
it runs (``Wrapped(impl, around=...)``); ``vdpcp mutants --impl X`` runs them against a user's implementation.
To add one: a function from the implementation to its wrapper, under ``@generic(name, bug, kills=...)``, below the
others (MUTANTS keeps the order). ``gradient_changed`` is the plumbing of a gradient bug, also used by test
subjects whose gradients are off on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

from vdpcp.contract.protocol import MAIN_OUTPUT, outputs_of
from vdpcp.tools.mutants.registry import generic


class Wrapped:
    """An implementation with its sharded encode's outputs changed; everything else is the subject's own.

    ``change(outputs, config, group)`` gets the subject's outputs by name (vdpcp.contract.protocol.outputs_of) and
    returns them changed; ``around`` (optional) runs the subject's encode itself instead.
    """

    def __init__(self, subject, change=None, around=None, spans=(), planted=None):
        self._subject, self._change, self._around = subject, change, around
        self._spans = spans  # what a change patched for a span (vdpcp.tools.mutants.collectives), closed at the case's end
        self.planted = planted  # a sized mutant's count of the elements it moved (vdpcp.tools.mutants.sized.Planted)

    def close(self) -> None:
        for span in self._spans:
            span.close()

    def __getattr__(self, attr):
        return getattr(self._subject, attr)

    def encode_sharded(self, model, inputs, config, group):
        if self._around is not None:
            return self._around(self._subject, model, inputs, config, group)
        outputs = outputs_of(self._subject.encode_sharded(model, inputs, config, group), "encode_sharded")
        return self._change(outputs, config, group) if config.shard_vision else outputs


class MutantDoesNotApply(RuntimeError):
    """The implementation lacks what the mutant changes (a second output, say): nothing to mutate."""


NOT_APPLICABLE = "mutant does not apply"


def gradient_changed(tensor, change: Callable):
    """``tensor`` as it is going forward; its gradient handed back as ``change(gradient)``: the plumbing of a
    gradient bug (mutants here, and test subjects whose gradients are off on purpose)."""
    import torch

    class Changed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return change(grad)

        @staticmethod
        def jvp(ctx, tangent):  # forward-mode: the identity, so vdpcp's row codes (vdpcp.oracle.observe.reads) pass through it
            return tangent.view_as(tangent)

    return Changed.apply(tensor)


def cp_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _roll_on_last_rank(outputs, name: str, group):
    """The last CP rank's copy of output ``name`` off by one row (a rank-local indexing bug); other ranks untouched."""
    import torch.distributed as dist

    if cp_rank(group) == dist.get_world_size(group) - 1 and outputs[name].shape[0] > 1:
        outputs[name] = outputs[name].roll(1, 0)
    return outputs


@generic(
    "features-rolled-on-last-rank",
    "the last CP rank's copy of the gathered features is off by one row (a rank-local indexing bug): every "
    "other rank is right",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _features_rolled_on_last_rank(impl):
    def change(outputs, config, group):
        return _roll_on_last_rank(outputs, MAIN_OUTPUT, group)

    return Wrapped(impl, change)


@generic(
    "secondary-output-rolled-on-last-rank",
    "a second output over the same tokens (DeepStack features, say) is gathered out of rank order on the last CP "
    "rank: the main features are right everywhere",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _secondary_output_rolled_on_last_rank(impl):
    def change(outputs, config, group):
        secondary = [name for name in outputs if name != MAIN_OUTPUT]
        if not secondary:
            raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {impl.name} returns one output, so it has no second one to "
                                     f"get wrong")
        return _roll_on_last_rank(outputs, secondary[-1], group)

    return Wrapped(impl, change)


@generic(
    "grad-dropped-on-rank-1",
    "CP rank 1's language-model gradient never reaches the ranks that own the images (zeroed before the "
    "gather's backward): forward is right, and so is every other rank's contribution",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count-zigzag"),
)
def _grad_dropped_on_rank_1(impl):
    import torch

    def change(outputs, config, group):  # rank 1 still takes part in every backward collective, with zeros
        if cp_rank(group) != 1:
            return outputs
        return {name: gradient_changed(t, torch.zeros_like) for name, t in outputs.items()}

    return Wrapped(impl, change)


@generic(
    "loss-replicated",
    "each CP rank's loss gradient is summed over the CP group before the gather's backward (as if every rank's "
    "loss covered every rank's tokens), so the summed gradients count each row CP times",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _loss_replicated(impl):
    from vdpcp.feature import comm

    def change(outputs, config, group):
        summed = lambda grad: comm.all_reduce_sum(grad.contiguous(), group)  # noqa: E731
        return {name: gradient_changed(t, summed) for name, t in outputs.items()}

    return Wrapped(impl, change)


@generic(
    "tower-detached-on-last-rank",
    "the last CP rank runs its tower outside autograd (parameters frozen for its call), so its outputs are right "
    "but its tower gets no gradient: the placeholder-only rank that skips its real work, seen from outside",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
    # an equal share and a placeholder rank: the two ways the last rank's tower can be the one detached
)
def _tower_detached_on_last_rank(impl):
    import torch.distributed as dist

    def encode_sharded(subject, model, inputs, config, group):
        if not (config.shard_vision and cp_rank(group) == dist.get_world_size(group) - 1):
            return subject.encode_sharded(model, inputs, config, group)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        try:
            return subject.encode_sharded(model, inputs, config, group)
        finally:
            for p in params:
                p.requires_grad_(True)

    return Wrapped(impl, around=encode_sharded)


@generic(
    "whole-microbatch-encoded-without-grad",
    "every CP rank also runs the whole microbatch through its tower under torch.no_grad() (to count its tokens, or a "
    "debug path left in) before its own share: outputs and gradients are right, but each rank does the tower's work "
    "for every image again, and the feature's compute win is gone",
    kills=("three-images-cp2-reference-count", "eight-equal-cp2-reference-count"),
)
def _whole_microbatch_encoded_without_grad(impl):
    import torch

    def encode_sharded(subject, model, inputs, config, group):
        if config.shard_vision:
            with torch.no_grad():
                subject.encode(model, inputs)
        return subject.encode_sharded(model, inputs, config, group)

    return Wrapped(impl, around=encode_sharded)


def _backward_kept_local(impl, on_rank: Callable, what: str):
    """``impl`` whose CP-group collectives, on the ranks ``on_rank(group)`` picks, are kept local for the backward
    of its outputs (vdpcp.tools.mutants.collectives). A subject whose backward runs none of them over the CP group has
    nothing this changes: the end of that backward says so."""
    from vdpcp.tools.mutants.collectives import LocalBackward

    spans = []

    def change(outputs, config, group):
        if not on_rank(group):
            return outputs
        span = LocalBackward(group, ended=lambda calls: _crossed(calls, impl, what))
        spans.append(span)
        return {name: gradient_changed(t, span.opened) for name, t in outputs.items()}

    return Wrapped(impl, change, spans=spans)


def _crossed(calls: int, impl, what: str) -> None:
    if calls == 0:
        raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {impl.name}'s backward runs no torch.distributed collective "
                                 f"over the CP group ({what} cannot be planted from outside)")


@generic(
    "gather-backward-unsummed",
    "the gather's backward keeps only this rank's own gradient, never summed over the CP group (a backward that "
    "slices its rows without the all-reduce, or a non-differentiable all_gather with the local shard put back): "
    "every collective the subject's backward runs over the CP group keeps this rank's own part",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _gather_backward_unsummed(impl):
    return _backward_kept_local(impl, lambda group: True, "a backward that sums nothing")


@generic(
    "last-rank-skips-backward-collective",
    "the last CP rank never enters the gather's backward collective (a rank with no image, or a frozen tower, "
    "whose outputs need no gradient): its peers wait in it, or meet that rank's next collective instead",
    kills=("eight-equal-cp2-reference-count",),
)
def _last_rank_skips_backward_collective(impl):
    import torch.distributed as dist

    last = lambda group: cp_rank(group) == dist.get_world_size(group) - 1  # noqa: E731
    return _backward_kept_local(impl, last, "a rank that skips the backward collective")


@generic(
    "gather-backward-all-reduces-in-place",
    "the gather's backward all-reduces the gradient it is handed in place (summing the caller's buffer instead of a "
    "copy of it): its own result is right, but every other reader of that buffer, the text stream the features "
    "were merged into, gets the sum over the CP group instead of its own rank's gradient",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _gather_backward_all_reduces_in_place(impl):
    def change(outputs, config, group):
        return {name: gradient_changed(t, lambda grad: _summed_in_place(grad, group)) for name, t in outputs.items()}

    return Wrapped(impl, change)


def _summed_in_place(grad, group):
    """``grad`` summed over ``group`` in the buffer it came in (where it is contiguous: ``contiguous()`` returns the
    buffer itself then); the subject's own backward gets what it was handed, and sums it as it always does."""
    import torch.distributed as dist

    handed = grad.clone()
    buffer = grad.contiguous()
    dist.all_reduce(buffer, group=group)
    return handed


@generic(
    "tower-collective-left-in",
    "a tensor-parallel collective left inside the tower when it runs data-parallel (a vocab-parallel embedding's "
    "all-reduce): the first layer's output is summed over the CP group in the sharded encode, so each rank's "
    "features mix every rank's images, or the ranks' different shapes break the collective",
    kills=("eight-equal-cp2-reference-count", "three-images-cp4-reference-count"),
)
def _tower_collective_left_in(impl):
    def encode_sharded(subject, model, inputs, config, group):
        if not config.shard_vision:
            return subject.encode_sharded(model, inputs, config, group)
        first = next((m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters())),
                     None)
        if first is None:
            raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {impl.name}'s model has no layer with parameters")
        handle = first.register_forward_hook(lambda module, args, output: _summed_forward(output, group))
        try:
            return subject.encode_sharded(model, inputs, config, group)
        finally:
            handle.remove()

    return Wrapped(impl, around=encode_sharded)


def _summed_forward(output, group):
    """``output`` summed over ``group`` going forward; its gradient passed through as it is (a layer's own
    all-reduce, whose backward is the identity on each rank)."""
    import torch.distributed as dist

    summed = output.detach().clone()
    dist.all_reduce(summed, group=group)
    return output + (summed - output.detach())


@generic(
    "partition-cost-squared",
    "the partition balances each unit's cost as p^2 alone (Automodel's cost_alpha=0, its model before the linear "
    "term), not the p * (p + alpha) it declares: small frames heap onto few ranks, outputs and gradients right",
    kills=("video-t4-ragged-cp4-reference-count",),
)
def _partition_cost_squared(impl):
    import copy

    if not hasattr(impl, "frame_sharding") or not hasattr(impl, "thresholds"):
        raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {impl.name} has no partition cost of its own to set (Automodel's "
                                 f"frame sharding config)")
    squared = copy.copy(impl)  # the subject's own code, its own config's cost_alpha=0: called, not patched
    squared.thresholds = {**impl.thresholds, "cost_alpha": 0}
    return squared


class _Loaded(Wrapped):
    """A wrapper that sees the microbatch the subject is handed (its ``inputs(batch)``): the pixels as they came,
    a loader's float32 host pixels in the matrix's loader cases (vdpcp.feature.pixels), and the spec its plan is of."""

    def __init__(self, subject, change=None, around=None, handed=None):
        super().__init__(subject, change, around)
        self._handed, self.batch = handed, None

    def inputs(self, batch):
        self.batch = batch
        return self._subject.inputs(batch if self._handed is None else self._handed(batch))


def _empty_rank(wrapper: _Loaded, impl, config, group) -> bool:
    """Whether this CP rank owns no row of the microbatch under the subject's own plan."""
    plan = impl.plan(wrapper.batch.spec, config)
    if plan is None:
        raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {impl.name} states no plan, so which rank is empty is not known "
                                 f"from outside")
    return cp_rank(group) not in plan.owner


def _moves_its_own_pixels(impl) -> None:
    """A bug of where pixels go needs a subject that takes them on the host and moves them itself."""
    from vdpcp.feature.pixels import loader_pixels

    if loader_pixels(impl) != "host":
        raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {impl.name} declares loader_pixels={loader_pixels(impl)!r}: its "
                                 f"framework moves every batch to the device, so it has no host pixels to move")


def _on_empty_rank(impl, change):
    """``impl`` whose outputs on a rank that owns no row are ``change(outputs, pixels)``: an empty rank's
    placeholder built like the pixels it was handed, seen at its outputs (its gather returns its own buffer's)."""
    wrapper = _Loaded(impl)

    def edit(outputs, config, group):
        if not _empty_rank(wrapper, impl, config, group):
            return outputs
        return {name: change(t, wrapper.batch.patches) for name, t in outputs.items()}

    wrapper._change = edit
    return wrapper


@generic(
    "placeholder-takes-pixels-dtype",
    "a rank that owns no image builds its placeholder features in the pixels' dtype, not the encoder output's: with "
    "a loader's float32 pixels and a bf16 or float64 tower, its gathered features come out in float32",
    kills=("one-image-cp2-reference-count-loader", "three-images-cp4-reference-count-loader"),
)
def _placeholder_takes_pixels_dtype(impl):
    return _on_empty_rank(impl, lambda t, pixels: t.to(pixels.dtype))


@generic(
    "placeholder-on-pixels-device",
    "a rank that owns no image builds its placeholder features on the pixels' device (the host a loader leaves them "
    "on), not the tower's: its gathered features come out in host memory",
    kills=("one-image-cp2-reference-count-loader", "three-images-cp4-reference-count-loader"),
)
def _placeholder_on_pixels_device(impl):
    _moves_its_own_pixels(impl)

    def change(t, pixels):
        moved = t.to(pixels.device)
        # Host and device one memory (the CPU): a value made on the host from the pixels, which vdpcp.oracle.observe.traffic's
        # stand-in holds to be host memory, as a buffer of the pixels' device would be.
        return moved if moved.device != t.device else moved + pixels.new_zeros(())

    return _on_empty_rank(impl, change)


@generic(
    "whole-microbatch-moved-to-device",
    "every rank moves the whole microbatch's pixels to its device, then slices its share there: outputs and "
    "gradients right, CP x the host-to-device traffic and the pixel memory on every rank",
    kills=("one-image-cp2-reference-count-loader", "mixed-sizes-cp2-reference-count-loader"),
)
def _whole_microbatch_moved_to_device(impl):
    from dataclasses import replace

    _moves_its_own_pixels(impl)

    def whole_on_device(batch):
        return replace(batch, patches=batch.patches.to(batch.device))

    return _Loaded(impl, change=lambda outputs, config, group: outputs, handed=whole_on_device)
