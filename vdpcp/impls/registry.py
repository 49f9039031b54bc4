"""The registry of implementations under test, found by name or by ``module:object``.

``resolve("reference")`` looks the name up in the ``vdpcp.implementations`` entry-point group (vdpcp's own
built-ins are there: reference, mcore, qwen2_5_vl, automodel, automodel-shipped, nemotron-omni, bridge-qwen3-vl, and
bridge-qwen3-vl-0.5.0, the release before it held as a regression fixture, and bridge-exaone45, the installed
release's EXAONE 4.5, another; an installed package adds its own;
``SHIPPED`` finds vdpcp's own in a checkout that was never installed); anything with a colon is imported:
``resolve("my_vlm.vision_dp:impl")``. A bad target raises ImplError, one line naming the target and what was
expected. A shipped subject whose packages are missing or of a version it does not take is unavailable
(vdpcp.impls.needs): resolving it raises ImplError with that one line, before anything is imported, and
``defaults()`` leaves it out of a run that names no implementation, with the same line. Rank workers resolve the
same string, so a case carries the string, never the object.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points

from vdpcp.contract.protocol import REQUIRED, Adapted, Implementation
from vdpcp.impls.needs import unavailable

GROUP = "vdpcp.implementations"
BUILT_INS = ("reference", "mcore")  # what `vdpcp check` runs when no --impl is given
# vdpcp's own, as pyproject.toml registers them: also found from a checkout that was never installed (a GPU
# runner with PYTHONPATH pointing at it), where there is no entry-point metadata.
SHIPPED = {"reference": "vdpcp.impls.reference:reference", "mcore": "vdpcp.impls.mcore:mcore",
           "qwen2_5_vl": "vdpcp.impls.qwen2_5_vl:qwen2_5_vl", "automodel": "vdpcp.impls.automodel:automodel",
           "automodel-shipped": "vdpcp.impls.automodel:automodel_shipped",
           "nemotron-omni": "vdpcp.impls.nemotron_omni:nemotron_omni",
           "bridge-qwen3-vl": "vdpcp.impls.bridge_qwen3_vl:bridge_qwen3_vl",
           "bridge-qwen3-vl-0.5.0": "vdpcp.impls.bridge_qwen3_vl:bridge_qwen3_vl_0_5_0",
           "bridge-exaone45": "vdpcp.impls.bridge_exaone45:bridge_exaone45"}
# Releases held to vdpcp as regression fixtures: they must fail, so the benches' "every shipped subject" leaves them out.
FIXTURES = ("bridge-qwen3-vl-0.5.0", "bridge-exaone45")
CURRENT = tuple(name for name in SHIPPED if name not in FIXTURES)

__all__ = ["BUILT_INS", "CURRENT", "FIXTURES", "GROUP", "SHIPPED", "ImplError", "available", "defaults", "resolve",
           "unavailable"]


class ImplError(ValueError):
    """An --impl target that is not an implementation: the message names it and says what was expected."""


def available() -> dict[str, str]:
    """Registered implementation names -> their ``module:object`` targets (unavailable shipped ones included: they
    resolve to their one line)."""
    return {**SHIPPED, **{ep.name: ep.value for ep in entry_points(group=GROUP)}}


def defaults() -> tuple[tuple[str, ...], list[str]]:
    """What a run that names no implementation runs (BUILT_INS this environment can run), and a line for each
    built-in it leaves out."""
    left_out = {name: unavailable(name) for name in BUILT_INS}
    return tuple(name for name, why in left_out.items() if not why), [why for why in left_out.values() if why]


@functools.cache
def resolve(target: str) -> Implementation:
    """The implementation ``target`` names (a registered name, or ``module:object``)."""
    registered = available()
    if target in SHIPPED and unavailable(target):
        raise ImplError(f"--impl {target}: {unavailable(target)}")
    if target in registered:
        path = registered[target]
    elif ":" in target:
        path = target
    else:
        raise ImplError(f"--impl {target}: not a registered implementation ({', '.join(sorted(registered))}) "
                        f"and not a module:object target")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImplError(f"--impl {target}: cannot import module {module_name!r} ({err})") from None
    subject = module
    for part in attr.split("."):
        if not hasattr(subject, part):
            raise ImplError(f"--impl {target}: module {module_name!r} has no attribute {attr!r}")
        subject = getattr(subject, part)
    return _as_implementation(target, subject)


def _as_implementation(target: str, subject) -> Implementation:
    missing = [attr for attr in REQUIRED if not hasattr(subject, attr)]
    if isinstance(subject, type) and (issubclass(subject, Implementation) or not missing):
        try:  # a class with no arguments is as good as its instance, duck-typed or not (its methods need a self)
            subject = subject()
        except TypeError as err:
            raise ImplError(f"--impl {target}: class {subject.__name__} cannot be built with no arguments ({err}); "
                            f"expected an implementation or a class that needs none") from None
    if isinstance(subject, Implementation):
        return subject
    if missing:
        raise ImplError(f"--impl {target}: {type(subject).__name__} object is not an implementation of vision DP over "
                        f"CP (missing {', '.join(missing)}; expected a vdpcp.impls.Implementation)")
    return Adapted(subject)
