"""The plugin marks every test that takes the ``run_ranks`` fixture ``distributed``, and only those, before ``-m``
selects (the GPU job runs ``-m distributed``; a quick CPU run leaves them out with ``-m "not distributed"``)."""

import pytest

pytest_plugins = ["pytester"]

TESTS = """
    def test_on_ranks(run_ranks):
        pass

    def test_in_process():
        pass
"""


@pytest.mark.parametrize("expr, selected", [("distributed", "test_on_ranks"), ("not distributed", "test_in_process")])
def test_m_selects_by_whether_a_test_takes_run_ranks(pytester, expr, selected):
    pytester.makepyfile(test_marked=TESTS)
    result = pytester.runpytest("-m", expr, "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert [line.split("::")[-1] for line in result.stdout.lines if "::" in line] == [selected], result.stdout.str()
