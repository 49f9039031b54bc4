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


def test_sizing_is_at_the_front_door_and_every_implementations_default():
    from vdpcp.contract import sizing

    assert "Sizing" in vdpcp.__all__ and vdpcp.Sizing is sizing.Sizing
    assert type(vdpcp.Implementation().sizing) is vdpcp.Sizing


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'encode'"):
        vdpcp.encode  # noqa: B018


def test_importing_vdpcp_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, vdpcp; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("old", ["vdpcp.protocol", "vdpcp.impls.base", "vdpcp.plan", "vdpcp.scenarios",
                                 "vdpcp.mutants.registry", "vdpcp.harness.protocol"])
def test_an_old_import_path_is_the_module_it_became_with_a_deprecation_warning(old, monkeypatch):
    import importlib

    from vdpcp import _deprecated

    for name in (old, old.rpartition(".")[0]):  # so the alias (a moved package's too) is found again, forgotten after
        if _deprecated.new_name(name):
            parent, _, leaf = name.rpartition(".")
            monkeypatch.setitem(sys.modules, name, None)  # recorded, so the teardown removes what the import adds
            del sys.modules[name]
            if parent in sys.modules:  # the attribute the import sets on its package
                monkeypatch.setattr(sys.modules[parent], leaf, None, raising=False)
                monkeypatch.delattr(sys.modules[parent], leaf)
    with pytest.warns(DeprecationWarning) as said:
        module = importlib.import_module(old)
    assert f"{old} moved to {_deprecated.new_name(old)}" in [str(w.message).split(";")[0] for w in said]
    assert module is importlib.import_module(_deprecated.new_name(old))


def test_every_old_path_names_a_module_that_exists():
    import importlib.util

    from vdpcp import _deprecated

    assert [old for old, now in _deprecated.MOVED.items() if importlib.util.find_spec(now) is None] == []
    assert [old for old, now in _deprecated.MOVED_PACKAGES.items() if importlib.util.find_spec(now) is None] == []


def test_the_contracts_names_from_vdpcp_impls_still_resolve_with_a_deprecation_warning():
    import vdpcp.impls

    with pytest.warns(DeprecationWarning, match="vdpcp.impls.Implementation moved: import it from vdpcp"):
        assert vdpcp.impls.Implementation is vdpcp.Implementation
    with pytest.raises(AttributeError, match="no attribute 'encode'"):
        vdpcp.impls.encode  # noqa: B018
