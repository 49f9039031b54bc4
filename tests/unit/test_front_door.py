"""The front door: every public name resolves from ``vdpcp`` to its defining module's object, and importing
``vdpcp`` alone imports no torch (the CLI's --help and the rank zygote's start stay cheap)."""

import subprocess
import sys

import pytest

import vdpcp


@pytest.mark.parametrize("name", vdpcp.__all__)
def test_every_public_name_is_its_modules_own(name):
    module = sys.modules.get(vdpcp._PUBLIC[name]) or __import__(vdpcp._PUBLIC[name], fromlist=[name])
    assert getattr(vdpcp, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'encode'"):
        vdpcp.encode  # noqa: B018


def test_importing_vdpcp_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, vdpcp; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
