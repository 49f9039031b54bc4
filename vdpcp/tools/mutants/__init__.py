"""Named mutants: plausible bugs the matrix must catch.

A mutant is a set of monkeypatches over vdpcp's own modules (never MCore's), or a wrapper around any
implementation, applied inside every rank for the duration of one case, so the reference code itself stays
clean. ``vdpcp mutants`` runs the matrix against each and reports which case killed it.

Each mutant names its kill set: a few matrix case ids (vdpcp.matrix.scenarios), in order, that should kill it, so
the search can stop at the first kill. A mutant that survives its kill set is then run against the whole
matrix before it is called a survivor.

    registry.py       the Mutant record, MUTANTS, the @mutant and @generic decorators, applied()
    sharded_path.py   the named bugs of vdpcp's own sharded path (@mutant)
    interface.py      the generic mutants, at the interface of any implementation (@generic)
    sized.py          perturbations of a chosen size (NAME@SIZE), for `vdpcp bench sensitivity`; not in MUTANTS
    collectives.py    the CP group's collectives kept local for a backward: the field's gather-backward bugs, from outside

This package is the registry's public face: importing it registers every mutant, the sharded path's first.
"""

# isort: off
# Registering, in this order: MUTANTS lists (and `vdpcp mutants` runs) the sharded path's bugs first.
from vdpcp.tools.mutants import sharded_path  # noqa: F401
from vdpcp.tools.mutants import interface  # noqa: F401
from vdpcp.tools.mutants import sized  # noqa: F401
# isort: on
from vdpcp.tools.mutants.interface import NOT_APPLICABLE, MutantDoesNotApply, gradient_changed
from vdpcp.tools.mutants.registry import MUTANTS, SIZED, Mutant, applied, generic, known, mutant
from vdpcp.tools.mutants.sized import planted

__all__ = ["MUTANTS", "NOT_APPLICABLE", "SIZED", "Mutant", "MutantDoesNotApply", "applied", "generic",
           "gradient_changed", "known", "mutant", "planted"]
