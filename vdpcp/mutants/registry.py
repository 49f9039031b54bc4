"""The registry of mutants: the Mutant record, MUTANTS, the two decorators that fill it, and ``applied``.

A mutant is either a set of monkeypatches over vdpcp's own modules (``@mutant``: vdpcp.mutants.sharded_path) or a
wrapper around any implementation (``@generic``: vdpcp.mutants.interface). ``applied`` puts one in force inside a
rank for the duration of one case, so the reference code itself stays clean. MUTANTS keeps the order the mutants
are registered in, which is the order ``vdpcp mutants`` runs them in.
"""

from __future__ import annotations

import importlib
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


@contextmanager
def applied(name: str | None, impl):
    """The implementation to check while the named mutant is in force (``impl`` itself for None)."""
    if name is None:
        yield impl
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
