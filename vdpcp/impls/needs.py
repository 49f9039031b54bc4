"""What each shipped subject needs installed, checked by version before its module is imported.

A subject whose package is missing, or of a version it was not measured with, is unavailable: one line names the
package, the versions it takes and the install command, so a training image without transformers (say) runs the
other subjects and says which it left out, instead of failing at an import. The ranges are the measured ones
(docs/environment.md); a package's lower end is the oldest release a subject's matrix passed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Need:
    """A package a subject imports: ``requirement`` as PEP 508 writes it, ``install`` the command that brings it."""

    requirement: str
    install: str

    def missing(self) -> str:
        """What is wrong with the installed package ("" when it meets the requirement)."""
        wanted = Requirement(self.requirement)
        try:
            found = metadata.version(wanted.name)
        except metadata.PackageNotFoundError:
            return f"{wanted.name} is not installed"
        try:
            fits = wanted.specifier.contains(Version(found), prereleases=True)
        except InvalidVersion:
            fits = False
        return "" if fits else f"{wanted.name} {found} is installed"


@dataclass(frozen=True)
class Release:
    """An older release held as a regression fixture, in a folder of the environment's own (off sys.path)."""

    requirement: str  # NAME==VERSION, as requirements/releases.txt pins it
    install: str = "requirements/install-releases PYTHON, from a vdpcp checkout"

    def missing(self) -> str:
        from vdpcp.impls import bridge_release

        name, _, version = self.requirement.partition("==")
        try:
            bridge_release.distribution(version)
        except (bridge_release.ReleaseError, metadata.PackageNotFoundError):  # the folder, or the package itself
            return f"{name} {version} is not installed in {bridge_release.RELEASES}/"
        return ""


MEGATRON_CORE = Need("megatron-core>=0.18", "pip install 'megatron-core>=0.18'")
# RADIO's dynamic resolution (the arguments Nemotron Omni passes) is megatron-core 0.19's: 0.18's raises on them.
RADIO = Need("megatron-core>=0.19", "pip install 'megatron-core>=0.19'")
EINOPS = Need("einops>=0.8", "pip install 'vdpcp[radio]'")
TRANSFORMERS = Need("transformers>=5.12.1", "pip install 'vdpcp[transformers]'")
AUTOMODEL = Need("nemo-automodel>=0.7", "pip install --no-deps 'nemo-automodel>=0.7'")
PYDANTIC = Need("pydantic", "pip install pydantic")  # the one dependency of the module vdpcp calls that torch lacks
BRIDGE = Need("megatron-bridge>=0.6.2", "pip install --no-deps 'megatron-bridge>=0.6.2'")

NEEDS = {
    "reference": (),
    "mcore": (MEGATRON_CORE,),
    "qwen2_5_vl": (TRANSFORMERS,),
    "automodel": (AUTOMODEL, PYDANTIC, TRANSFORMERS),
    "automodel-shipped": (AUTOMODEL, PYDANTIC, TRANSFORMERS),
    "nemotron-omni": (RADIO, EINOPS),
    "bridge-qwen3-vl": (BRIDGE, MEGATRON_CORE, TRANSFORMERS),
    "bridge-qwen3-vl-0.5.0": (Release("megatron-bridge==0.5.0"), MEGATRON_CORE, TRANSFORMERS),
    "bridge-exaone45": (BRIDGE, MEGATRON_CORE, TRANSFORMERS),
}


def unavailable(name: str) -> str:
    """Why shipped subject ``name`` cannot run in this environment, in one line ("" when it can, or is not ours)."""
    for need in NEEDS.get(name, ()):
        why = need.missing()
        if why:
            return f"{name} needs {need.requirement} ({why}): {need.install}"
    return ""
