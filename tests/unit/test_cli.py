"""The CLI keeps its choices literal (so `vdpcp --help` imports no torch); they must stay the code's own."""

import tomllib
from pathlib import Path

from vdpcp import cli, impls
from vdpcp.cli import ab
from vdpcp.feature import model, plan
from vdpcp.matrix import case


def test_cli_choices_are_the_codes_own():
    assert cli.LOSSES is case.LOSSES and cli.DTYPES is case.DTYPES  # one tuple each (vdpcp.matrix.choices), not copies
    assert cli.SPLITS == plan.STRATEGIES


def test_the_shipped_implementations_are_the_entry_points_pyproject_registers():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"][impls.GROUP] == impls.SHIPPED


def test_ab_towers_are_the_models_own():
    assert ab.TOWERS == tuple(model.TOWERS)
