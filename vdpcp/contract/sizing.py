"""What an implementation's tower costs a case, declared so that vdpcp sizes the case before anything is built.

An implementation reaches it as ``impl.sizing``: a ``Sizing`` by default, whose every figure is None (vdpcp's own:
its toy tower's where the implementation builds that tower). One with a tower of its own declares a subclass with
its figures, ``sizing = MySizing()``; vdpcp.matrix.budget reads every figure through it, and refuses a case over the
limit in one line before it runs.

Like protocol.py, this module imports nothing of vdpcp's.
"""

from __future__ import annotations

import warnings

# Sizing hooks an implementation may still define on itself, read with a DeprecationWarning for one release.
SIZING_HOOKS = ("patch_bytes", "param_count", "full_attention")


class Sizing:
    """An implementation's sizing figures for a case. Subclass it and override the figures your tower differs in."""

    def patch_bytes(self, case) -> int | None:
        """The bytes one patch of the microbatch costs one arm of the encoder: its inputs, the activations kept for
        backward and their gradients, at ``case.dtype``. None: vdpcp's estimate for its toy tower."""
        return None

    def param_count(self, case) -> int | None:
        """The tower's parameters: a rank holds the model and up to three sets of its gradients. None: the toy tower's
        where the implementation builds it, else unknown."""
        return None

    def full_attention(self, case) -> tuple[int, int] | None:
        """(layers that attend over a whole image, their heads): where no fused kernel takes the dtype (float64 on
        CUDA), their n x n scores are most of an arm's memory. None: the toy tower's where the implementation builds
        it, else unknown."""
        return None


class HookSizing(Sizing):
    """The sizing hooks an implementation defines on itself, the spelling before ``sizing``; a hook it lacks is
    ``Sizing``'s. A hook that is a value, not a method, is that value for every case."""

    def __init__(self, impl):
        self.impl = impl

    def _hook(self, part: str, case):
        hook = getattr(self.impl, part, None)
        return hook(case) if callable(hook) else hook

    def patch_bytes(self, case) -> int | None:
        return self._hook("patch_bytes", case)

    def param_count(self, case) -> int | None:
        return self._hook("param_count", case)

    def full_attention(self, case) -> tuple[int, int] | None:
        return self._hook("full_attention", case)


# Implementations already told, by (class, name): one warning each, however many cases are sized.
_warned: set[tuple[str, str]] = set()


def sizing_of(impl) -> Sizing:
    """``impl``'s sizing where it defines none: its own hooks, with one DeprecationWarning naming it and the new
    spelling, else the defaults."""
    hooks = [part for part in SIZING_HOOKS if getattr(impl, part, None) is not None]
    if not hooks:
        return Sizing()
    name = str(getattr(impl, "name", type(impl).__name__))
    key = (f"{type(impl).__module__}.{type(impl).__qualname__}", name)
    if key not in _warned:
        _warned.add(key)
        said = ", ".join(f"{part}(case)" for part in hooks)
        warnings.warn(f"implementation {name!r} defines {said} on itself; declare them on a vdpcp.Sizing subclass "
                      f"instead (sizing = MySizing()): the hooks on the implementation go in the next release",
                      DeprecationWarning, stacklevel=3)
    return HookSizing(impl)
