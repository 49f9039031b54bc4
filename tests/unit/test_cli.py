"""The CLI keeps its choices literal (so `vdpcp --help` imports no torch); they must stay the code's own."""

from vdpcp import case, cli, plan


def test_cli_choices_are_the_codes_own():
    assert cli.LOSSES == case.LOSSES
    assert cli.DTYPES == tuple(case.DTYPES)
    assert cli.SPLITS == plan.STRATEGIES
