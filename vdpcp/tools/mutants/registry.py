"""The registry of mutants: the Mutant record, MUTANTS, the two decorators that fill it, and ``applied``.

A mutant is either a set of monkeypatches over vdpcp's own modules (``@mutant``: vdpcp.tools.mutants.sharded_path) or a
wrapper around any implementation (``@generic``: vdpcp.tools.mutants.interface). ``applied`` puts one in force inside a
rank for the duration of one case, so the reference code itself stays clean. MUTANTS keeps the order the mutants
are registered in, which is the order ``vdpcp mutants`` runs them in. A sized mutant (``@sized``:
vdpcp.tools.mutants.sized) is a wrapper that takes a size too, named ``NAME@SIZE``; SIZED holds them apart from MUTANTS.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # the plausible bug, in one sentence
    patches: Callable[[], dict[str, object]] | None = None  # "module:attr" -> replacement, built inside the rank
    wrap: Callable[[object], object] | None = None  # implementation -> mutated implementation (any implementation)
    kills: tuple[str, ...] = ()  # matrix case ids expected to kill it (for the reference), cheapest and surest first

    @property
    def generic(self) -> bool:
        return self.wrap is not None


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, bug: str, kills: tuple[str, ...] = ()):
    """A named bug in vdpcp's own sharded path, as monkeypatches of its modules."""
    def register(patches):
        MUTANTS[name] = Mutant(name, bug, patches=patches, kills=tuple(kills))
        return patches

    return register


def generic(name: str, bug: str, kills: tuple[str, ...] = ()):
    """A bug at the interface, for any implementation: a wrapper around it."""
    def register(wrap):
        MUTANTS[name] = Mutant(name, bug, wrap=wrap, kills=tuple(kills))
        return wrap

    return register


@dataclass(frozen=True)
class Sized:
    name: str
    bug: str  # with {eps} for the size
    wrap: Callable[[object, float], object]  # (implementation, size) -> mutated implementation


SIZED: dict[str, Sized] = {}


def sized(name: str, bug: str):
    def register(wrap):
        SIZED[name] = Sized(name, bug, wrap)
        return wrap

    return register


def parse(name: str) -> tuple[Sized, float] | None:
    """``<name>@<size>`` as (its sized mutant, the size); None for a name without ``@``. ValueError naming the
    input when the name is unknown or the size is not a finite positive number."""
    if "@" not in name:
        return None
    base, _, size = name.partition("@")
    if base not in SIZED:
        raise ValueError(f"mutant {name!r}: unknown sized mutant {base!r}; expected one of {sorted(SIZED)} as NAME@SIZE")
    try:
        eps = float(size)
    except ValueError:
        eps = math.nan
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"mutant {name!r}: size {size!r} is not a positive number; expected NAME@SIZE, e.g. "
                         f"{base}@1e-3")
    return SIZED[base], eps


@contextmanager
def applied(name: str | None, impl):
    """The implementation to check while the named mutant is in force (``impl`` itself for None); a sized one
    (``NAME@SIZE``, vdpcp.tools.mutants.sized) wraps it at that size."""
    if name is None:
        yield impl
        return
    found_sized = parse(name)
    if found_sized is not None:
        yield found_sized[0].wrap(impl, found_sized[1])
        return
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {sorted(MUTANTS)}")
    found = MUTANTS[name]
    if found.generic:
        wrapped = found.wrap(impl)
        try:
            yield wrapped
        finally:  # a wrapper that patched something for a span the case may not have finished puts it back
            getattr(wrapped, "close", lambda: None)()
        return
    saved = []
    try:
        for target, replacement in found.patches().items():
            module_name, attr = target.split(":")
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, replacement)
        yield impl
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


def known(name: str) -> bool:
    """Whether ``name`` is a mutant: one of MUTANTS, or a sized one at a valid size (ValueError says what is wrong)."""
    return name in MUTANTS or parse(name) is not None
