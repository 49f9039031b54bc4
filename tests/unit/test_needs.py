"""A shipped subject whose package is missing or of a version it does not take: one line naming the package, its
versions and the install command, wherever the subject is asked for; a run that names none runs the rest."""

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from vdpcp import cli, impls
from vdpcp.impls import needs

REPO = Path(__file__).resolve().parents[2]
REAL_VERSION = metadata.version


@pytest.fixture
def without(monkeypatch):
    """Make the named distributions look uninstalled (or of another version) to vdpcp.impls.needs, for one test."""
    faked: dict[str, str | None] = {}

    def version(name):
        if name in faked:
            if faked[name] is None:
                raise metadata.PackageNotFoundError(name)
            return faked[name]
        return REAL_VERSION(name)

    monkeypatch.setattr(needs.metadata, "version", version)
    impls.resolve.cache_clear()
    yield faked
    impls.resolve.cache_clear()


def test_a_missing_package_makes_its_subjects_unavailable_with_one_line(without):
    without["transformers"] = None
    line = "qwen2_5_vl needs transformers>=5.12.1 (transformers is not installed): pip install 'vdpcp[transformers]'"
    assert impls.unavailable("qwen2_5_vl") == line
    assert impls.unavailable("automodel").startswith("automodel needs ")
    assert impls.unavailable("reference") == impls.unavailable("mcore") == ""
    with pytest.raises(impls.ImplError, match=f"^--impl qwen2_5_vl: {line}$".replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        impls.resolve("qwen2_5_vl")


def test_a_version_it_does_not_take_is_said_as_the_installed_one(without):
    without["megatron-core"] = "0.16.1"
    assert impls.unavailable("mcore") == ("mcore needs megatron-core>=0.18 (megatron-core 0.16.1 is installed): "
                                          "pip install 'megatron-core>=0.18'")
    assert impls.unavailable("nemotron-omni").startswith("nemotron-omni needs megatron-core>=0.19 (megatron-core 0.16.1")


def test_check_with_an_unavailable_impl_exits_2_with_that_line(without, capsys):
    without["transformers"] = None
    assert cli.main(["check", "--impl", "qwen2_5_vl", "--cp", "2", "--list"]) == 2
    assert capsys.readouterr().err.strip() == f"vdpcp check: --impl qwen2_5_vl: {impls.unavailable('qwen2_5_vl')}"


def test_a_bare_check_runs_the_built_ins_it_can_and_says_which_it_left_out(without, capsys):
    without["megatron-core"] = "0.16.1"
    assert cli.main(["check", "--cp", "2", "--list"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"left out: {impls.unavailable('mcore')}"
    ids = out.split()
    assert ids and all("-reference-" in case_id for case_id in ids)


def test_subjects_lists_every_shipped_one_with_its_line(without, capsys):
    without["nemo-automodel"] = None
    assert cli.main(["subjects"]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert set(impls.SHIPPED) <= set(rows)
    assert rows["automodel"] == f"unavailable: {impls.unavailable('automodel')}"
    assert rows["reference"] == impls.SHIPPED["reference"]


def test_every_shipped_subject_has_its_needs_and_the_extras_declare_the_same_ranges():
    assert set(needs.NEEDS) == set(impls.SHIPPED)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["transformers"],
                *project["optional-dependencies"]["radio"]]
    assert {needs.MEGATRON_CORE.requirement, needs.TRANSFORMERS.requirement, needs.EINOPS.requirement} <= set(declared)


def test_the_floor_stack_pins_exactly_the_declared_floors():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    stacks = tomllib.loads((REPO / "requirements" / "stacks.toml").read_text())
    declared = [*project["dependencies"], *project["optional-dependencies"]["transformers"]]
    floors = {name: Version(floor) for name, _, floor in (text.partition(">=") for text in declared)}
    pinned = {name: Version(version) for name, _, version in (text.partition("==") for text in stacks["floors"]["install"])}
    assert pinned == floors
    for stack in stacks.values():
        assert set(stack["subjects"]) <= set(impls.SHIPPED)


def test_a_release_fixture_is_unavailable_where_its_package_is_not_installed_at_all(monkeypatch):
    from vdpcp.impls import bridge_release

    def nowhere(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(bridge_release.importlib.metadata, "distribution", nowhere)
    assert impls.unavailable("bridge-qwen3-vl-0.5.0").startswith(
        "bridge-qwen3-vl-0.5.0 needs megatron-bridge==0.5.0 (megatron-bridge 0.5.0 is not installed in releases/)")
