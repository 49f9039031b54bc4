"""Import paths that moved when vdpcp's modules were grouped by job: each still imports, for one release, as the
module it became, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old dotted path -> the module it is now
MOVED = {
    "vdpcp.protocol": "vdpcp.contract.protocol",
    "vdpcp.impls.base": "vdpcp.contract.protocol",
    "vdpcp.spec": "vdpcp.feature.spec", "vdpcp.plan": "vdpcp.feature.plan", "vdpcp.balance": "vdpcp.feature.balance",
    "vdpcp.sharded": "vdpcp.feature.sharded", "vdpcp.comm": "vdpcp.feature.comm", "vdpcp.layout": "vdpcp.feature.layout",
    "vdpcp.tensor_parallel": "vdpcp.feature.tensor_parallel", "vdpcp.model": "vdpcp.feature.model",
    "vdpcp.loss": "vdpcp.feature.loss", "vdpcp.grads": "vdpcp.feature.grads", "vdpcp.pixels": "vdpcp.feature.pixels",
    "vdpcp.datasets": "vdpcp.feature.datasets",
    "vdpcp.reads": "vdpcp.oracle.observe.reads", "vdpcp.traffic": "vdpcp.oracle.observe.traffic",
    "vdpcp.gloo_collectives": "vdpcp.oracle.observe.gloo_collectives",
    "vdpcp.load_balance": "vdpcp.oracle.observe.declared_balance",
    "vdpcp.oracle.execution": "vdpcp.oracle.observe.execution", "vdpcp.oracle.telemetry": "vdpcp.oracle.observe.telemetry",
    "vdpcp.oracle.handed": "vdpcp.oracle.observe.handed", "vdpcp.oracle.split": "vdpcp.oracle.observe.split",
    "vdpcp.precision": "vdpcp.oracle.compare.precision", "vdpcp.rounding": "vdpcp.oracle.compare.rounding",
    "vdpcp.regrouped": "vdpcp.oracle.compare.regrouped", "vdpcp.sketch": "vdpcp.oracle.compare.sketch",
    "vdpcp.oracle.gradients": "vdpcp.oracle.compare.gradients", "vdpcp.oracle.weights": "vdpcp.oracle.compare.weights",
    "vdpcp.model_cache": "vdpcp.oracle.model_cache",
    "vdpcp.scenarios": "vdpcp.matrix.scenarios", "vdpcp.case": "vdpcp.matrix.case",
    "vdpcp.expectations": "vdpcp.matrix.expectations", "vdpcp.budget": "vdpcp.matrix.budget",
    "vdpcp.saved": "vdpcp.matrix.saved", "vdpcp.runner": "vdpcp.matrix.runner", "vdpcp.report": "vdpcp.matrix.report",
    "vdpcp.progress": "vdpcp.matrix.progress",
    "vdpcp.fuzz": "vdpcp.tools.fuzz", "vdpcp.capture": "vdpcp.tools.capture", "vdpcp.hunt": "vdpcp.tools.mutants.hunt",
    "vdpcp.lm": "vdpcp.tools.ab.lm", "vdpcp.harness.protocol": "vdpcp.harness.messages",
}
# Moved packages: their submodules moved with them.
MOVED_PACKAGES = {"vdpcp.mutants": "vdpcp.tools.mutants", "vdpcp.bench": "vdpcp.tools.bench", "vdpcp.ab": "vdpcp.tools.ab"}


def new_name(old: str) -> str | None:
    """Where the module once imported as ``old`` lives now (None: it did not move)."""
    if old in MOVED:
        return MOVED[old]
    for package, now in MOVED_PACKAGES.items():
        if old == package or old.startswith(package + "."):
            return now + old[len(package):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module it became: one module object under both names."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

    def create_module(self, spec):
        now = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {now}; the old path goes in the next release "
                      f"(what a user's implementation and tests need is importable from vdpcp itself)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(now)

    def exec_module(self, module):
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
