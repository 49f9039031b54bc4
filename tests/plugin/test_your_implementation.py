"""README's "Testing your own implementation" works as written: its example, copied into a scratch project, is
selected by module:object and by an entry point, from the CLI, from pytest and from unittest, and the matrix
holds it to the same oracle as the built-ins. Bad targets are one clear usage error."""

import json
import re
import textwrap
import unittest
from pathlib import Path

import pytest

from vdpcp.cli import main
from vdpcp.oracle.observe import gloo_collectives

pytest_plugins = ["pytester"]

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A scratch project holding the README's example module, as the current folder and on sys.path."""
    block = re.search(r"<!-- example: (\S+) -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README lost its example"
    (tmp_path / block.group(1)).write_text(block.group(2))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_check_runs_the_example_by_module_and_object(project, capsys):
    code = main(["check", "--impl", "my_vision_dp:impl", "--cp", "2", "4", "-k", "three-images",
                 "--json", str(project / "r.json")])
    assert code == 0, capsys.readouterr().out
    records = json.loads((project / "r.json").read_text())["results"]
    assert {r["verdict"] for r in records} == {"pass"}
    # Its gather is torch.distributed.nn's all_gather: on gloo its backward ran through vdpcp's all_to_all, which
    # each of its sharded cases names, CP x DP layouts included (torch's own raises on their second CP group).
    sharded = [r for r in records if r["vision_dp_over_cp"] and r["config_cp"] is None]
    assert {r["collectives"] for r in sharded} == {gloo_collectives.NOTE} and any(r["dp"] > 1 for r in sharded)
    assert any(r["cp"] == 4 and r["verdict"] == "pass" and r["ranks"][3]["placeholders"] == 0 for r in records)


def test_an_installed_package_lists_it_by_entry_point_name(project, monkeypatch, capsys):
    site = project / "site"
    info = site / "my_vision_dp-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-vision-dp\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vdpcp.implementations]\nmy-vision-dp = my_vision_dp:impl\n")
    monkeypatch.syspath_prepend(str(site))
    from vdpcp.impls import available

    assert available()["my-vision-dp"] == "my_vision_dp:impl"
    assert main(["check", "--impl", "my-vision-dp", "--cp", "2", "-k", "eight-equal-cp2-my-vision-dp-count"]) == 0
    assert "my-vision-dp" in capsys.readouterr().out


def test_pytest_runs_its_matrix_with_vdpcp_impl(project, pytester):
    pytester.makepyfile(test_mine="""
        from vdpcp.testing import assert_case

        def test_vision_dp_over_cp(vdpcp_case):
            assert_case(vdpcp_case)
    """)
    result = pytester.runpytest("--vdpcp-impl", "my_vision_dp:impl", "--vdpcp-cp", "2", "-k", "eleven or three",
                                "-p", "no:randomly")
    result.assert_outcomes(passed=11)  # the CP x DP layouts too: its all_gather's backward runs on gloo


def test_unittest_expands_the_matrix_into_named_methods(project):
    from vdpcp.matrix import scenarios
    from vdpcp.testing import assert_case, expand

    three = [s for s in scenarios.scenarios() if s.spec.name == "three-images"]

    class TestMyEncoder(unittest.TestCase):
        @expand("my_vision_dp:impl", cps=(2,), table=three, special=False)
        def test(self, _, case):
            assert_case(case)

    names = unittest.TestLoader().getTestCaseNames(TestMyEncoder)
    assert "test_three_images_cp2_my_vision_dp_count" in names
    outcome = unittest.TextTestRunner(stream=open("/dev/null", "w")).run(unittest.TestLoader().loadTestsFromTestCase(TestMyEncoder))
    assert outcome.wasSuccessful() and outcome.testsRun == len(names) == 4 and outcome.skipped == []


@pytest.mark.parametrize("target, expected", [
    ("no_such_module:impl", "--impl no_such_module:impl: cannot import module 'no_such_module'"),
    ("my_vision_dp:nope", "--impl my_vision_dp:nope: module 'my_vision_dp' has no attribute 'nope'"),
    ("my_vision_dp:torch", "--impl my_vision_dp:torch: module object is not an implementation"),
    ("nonsense", "--impl nonsense: not a registered implementation"),
])
def test_a_bad_target_exits_2_with_one_line(project, capsys, target, expected):
    for argv in (["check", "--impl", target], ["mutants", "--impl", target], ["fuzz", "--cp", "2", "--impl", target]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err


def test_pytest_with_a_bad_target_is_a_usage_error(project, pytester):
    pytester.makepyfile(test_mine="def test_it(vdpcp_case): pass")
    result = pytester.runpytest("--vdpcp-impl", "no_such_module:impl")
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*--impl no_such_module:impl: cannot import module 'no_such_module'*"])


def test_an_implementation_that_skips_the_group_check_fails_the_mismatch_rows(project, capsys):
    (project / "lax.py").write_text(textwrap.dedent("""
        import torch.distributed as dist

        from my_vision_dp import MyVisionDP

        class Lax(MyVisionDP):  # a CP size that disagrees with the group: encodes everything instead of raising
            def encode_sharded(self, model, batch, config, group):
                if config.context_parallel_size != dist.get_world_size(group):
                    return self.encode(model, batch)
                return super().encode_sharded(model, batch, config, group)

        impl = Lax()
    """))
    assert main(["check", "--impl", "lax:impl", "--cp", "2", "-k", "config-cp4", "--json", str(project / "r.json")]) == 1
    record = json.loads((project / "r.json").read_text())["results"][0]
    assert record["why"].startswith("no rank reported 'vision_dp_over_cp does not match its process group'"), record


@pytest.mark.parametrize("argv, tower", [((), "toy"), (("--vdpcp-tower", "real"), "real")])
def test_the_matrix_cases_pytest_gets_carry_the_tower_size_asked_for(pytester, argv, tower):
    """--vdpcp-tower reaches every vdpcp_case, so a GPU job that asks for the real size gets it, not the toy matrix
    under another name. The bodies only read the case: no case runs."""
    pytester.makepyfile(test_mine=f"""
        def test_tower(vdpcp_case):
            assert vdpcp_case.tower == {tower!r}, vdpcp_case.id
    """)
    result = pytester.runpytest("--vdpcp-impl", "reference", "--vdpcp-cp", "2", *argv, "-p", "no:randomly")
    assert result.ret == pytest.ExitCode.OK and result.parseoutcomes()["passed"] >= 10, result.outlines[-3:]
