"""The check report as a CI log shows it: stdout is not a terminal there."""

from vdpcp.matrix import report, scenarios
from vdpcp.matrix.case import RankResult
from vdpcp.matrix.runner import CaseResult

LONG_WHY = ("a known upstream limit: MCore's gather backward needs NCCL for an uneven all_gather_into_tensor, "
            "so on gloo the case fails the known way")


def test_off_a_terminal_each_check_row_is_one_line_with_its_why_whole(capsys):
    case = next(c for c in scenarios.matrix((8,)) if c.impl == "mcore")  # eight ranks: the widest per-rank columns
    ranks = [RankResult(rank, 3, 1, 4000, backend="gloo", device="cpu") for rank in range(8)]
    row = report.CheckRow("exact-remainder", "xfail", LONG_WHY, CaseResult(case, ranks, backend="gloo"), 1.0)
    report.console().print(report.check_table([row], "gloo"))
    lines = capsys.readouterr().out.splitlines()
    assert any(LONG_WHY[:59] in line for line in lines), "\n".join(lines)  # the table shows 59 characters and "…"


def test_a_parameter_gradient_error_not_measured_element_by_element_shows_as_a_dash():
    case = next(c for c in scenarios.matrix((2,)) if c.grads)
    ranks = [RankResult(rank, rank, out_err=1e-3, input_grad_err=2e-3, param_grad_err=float("nan")) for rank in range(2)]
    result = CaseResult(case, ranks, backend="gloo")
    assert [report._err(result, attr) for attr, _ in report.ERRORS] == ["1.0e-03", "2.0e-03", "-"]
    ranks[1].param_grad_err = 0.0
    ranks[0].param_grad_err = 4e-3
    assert report._err(result, "param_grad_err") == "4.0e-03"
