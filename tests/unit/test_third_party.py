"""Third-party import notices are silenced precisely: the known messages, from their library, nothing else."""

import logging
import subprocess
import sys
import warnings

import pytest

from vdpcp.third_party import silence_import_notices

TE_APEX = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
ABSL = "absl.logging is not installed. Using logging.getLogger(__name__) instead."


@pytest.fixture(params=["pytest's filters", "vdpcp's alone"])
def filters(request):
    """The filters a test runs under (pytest's, with the lines vdpcp's plugin adds), or only the ones that
    silence_import_notices() sets in the CLI, the rank zygote and its ranks."""
    if request.param == "pytest's filters":
        yield
        return
    with warnings.catch_warnings():
        warnings.resetwarnings()
        silence_import_notices()
        yield


def shown(message: str, module: str) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(message, UserWarning, "megatron.py", 1, module=module, registry={})
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("message", [TE_APEX, ABSL])
def test_megatrons_notices_about_optional_packages_are_silenced(filters, message):
    assert shown(message, "megatron.core.optimizer") == []


@pytest.mark.parametrize("message, module", [("a real problem", "megatron.core.optimizer"), (TE_APEX, "another_library")])
def test_every_other_warning_still_shows(filters, message, module):
    assert shown(message, module) == [message]


def test_torch_logs_no_cuda_runtime_silenced_and_its_other_logs_not():
    logger = logging.getLogger("torch.utils.cpp_extension")
    record = lambda msg, arg: logger.makeRecord(logger.name, logging.WARNING, "cpp_extension.py", 1, msg, (arg,), None)  # noqa: E731
    assert not logger.filter(record("No CUDA runtime is found, using CUDA_HOME=%r", "/usr/local"))
    assert logger.filter(record("Error checking compiler version for %s", "c++"))


STAND_IN = """
import sys, types
from importlib.machinery import ModuleSpec

class Loader:  # prints as torch 2.6's cpp_extension does on import, and a line of its own
    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        print("No CUDA runtime is found, using CUDA_HOME='/usr/local'", file=sys.stderr)
        print("another notice", file=sys.stderr)

class Finder:
    def find_spec(self, name, path=None, target=None):
        return ModuleSpec(name, Loader()) if name == "torch.utils.cpp_extension" else None

sys.meta_path.insert(0, Finder())
from vdpcp import third_party
third_party.import_cpp_extension_quietly()
third_party.import_cpp_extension_quietly()  # once imported, nothing again
assert isinstance(sys.modules["torch.utils.cpp_extension"].__spec__.loader, Loader)
"""


def test_a_quiet_import_of_torchs_cpp_extension_drops_the_no_cuda_notice_and_nothing_else():
    """torch 2.6 prints the notice when the module is first imported (later versions log it): a stand-in module,
    in a fresh interpreter, prints it and a line of its own."""
    run = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "another notice\n"


def test_vdpcps_reads_warm_forward_mode_ad_at_import_with_torchs_jit_notice_dropped():
    """A fresh interpreter that imports vdpcp.oracle.observe.reads (as the rank zygote does, through vdpcp.matrix.runner) has what
    forward-mode AD loads at a first dual tensor already loaded, so workers forked from it do not load it each,
    and printed no notice of torch's own deprecated torch.jit.script use, with every warning shown."""
    code = "import sys, vdpcp.oracle.observe.reads; print('torch._decomp.decompositions_for_jvp' in sys.modules)"
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "True\n" and "torch.jit.script" not in run.stderr, run.stderr
