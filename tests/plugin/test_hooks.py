"""The plugin's hooks around each test: every test that takes the ``run_ranks`` fixture is marked ``distributed``,
and only those, before ``-m`` selects (the GPU job runs ``-m distributed``; a quick CPU run leaves them out with
``-m "not distributed"``); a backend this machine cannot give (``--backend nccl`` without a GPU per rank) skips the
test instead of failing it; a bad matrix option is a usage error."""

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


def test_a_backend_this_machine_cannot_give_skips_the_test_naming_why(pytester):
    pytester.makepyfile(test_backend="""
        from vdpcp.harness import BackendUnavailable

        def test_needs_gpus():
            raise BackendUnavailable("backend nccl needs 8 GPUs (one per rank), found 0")
    """)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*backend nccl needs 8 GPUs (one per rank), found 0*"])



@pytest.mark.parametrize("option, named", [(["--vdpcp-impl", "no_such_module:impl"], "--impl no_such_module:impl"),
                                           (["--vdpcp-tower", "huge"], "huge")])
def test_a_bad_matrix_option_is_reported_as_pytests_usage_error(pytester, option, named):
    """Raised while the matrix parametrizes, so pytest reports it as a collection error: of its kind, a usage error
    naming the option's value, not vdpcp's own exception out of the plugin."""
    pytester.makepyfile(test_matrix="def test_it(vdpcp_case): pass")
    result = pytester.runpytest(*option)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([f"ERROR test_matrix.py - pytest.UsageError: *{named}*"])


def test_a_bad_spec_limit_is_a_usage_error_naming_it(pytester):
    pytester.makepyfile(test_nothing="def test_it(): pass")
    result = pytester.runpytest("--vdpcp-max-spec-bytes", "many")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    assert result.stderr.str().startswith("ERROR: --vdpcp-max-spec-bytes is 'many'"), result.stderr.str()  # not --replay's
