"""vdpcp bench towers' summary: the figures a GPU runner's job is sized by, from the per-case rows."""

from vdpcp.tools.bench import towers


def _row(impl, cp, seconds, world=None, passing=True):
    return {"impl": impl, "cp": cp, "world": world or cp, "seconds": seconds, "passing": passing, "ranks": [],
            "verdict": "pass" if passing else "fail"}


def test_the_summary_gives_each_subjects_median_every_subjects_median_and_the_wall():
    rows = [_row("reference", 2, 1.0), _row("reference", 2, 3.0), _row("qwen2_5_vl", 2, 9.0),
            _row("qwen2_5_vl", 4, 20.0), _row("qwen2_5_vl", 2, 50.0, world=4, passing=False)]  # CP 2 x DP 2: apart
    rows.append({**_row("qwen2_5_vl", 2, 0.0, passing=False), "verdict": "refused"})  # never ran: no time to count
    text = towers.summary(rows, 83.0)
    assert "reference CP 2: median case 2.00 s over 2 cases" in text
    assert "qwen2_5_vl CP 2: median case 9.00 s over 1 cases" in text
    assert "every subject CP 2: median case 3.00 s over 3 cases (target 1.5 s)" in text
    assert "every subject CP 4: median case 20.00 s over 1 cases" in text
    assert text[-2] == ("1 refused before they ran: over this machine's memory or compute limit (their lines say which, and the "
                        "option that raises it)")
    assert text[-1].startswith("6 cases, 4 passing, in 83.0 s wall (target for the bf16 selection")
    assert "target" not in towers.summary(rows, 83.0, "float64")[-1]


def test_each_phase_is_printed_with_what_the_ranks_clocks_left_outside_them():
    row = {**_row("reference", 2, 2.5), "id": "x", "why": "",
           "ranks": [{"rank": 0, "model": "reused", "turns": False, "held": {}, "estimate": 0,
                      "ratio": None, "seconds": {"unsharded": 0.5, "sharded": 0.25, "gradients": 0.75}}]}
    assert "[unsharded 0.50 sharded 0.25 gradients 0.75 outside 1.00]" in towers.line(row)
    assert "reference CP 2: median seconds per phase, unsharded 0.50 sharded 0.25 gradients 0.75 outside 1.00" in \
        towers.summary([row, row], 5.0)


def test_a_case_too_large_for_this_machine_is_a_refused_line_and_the_selection_goes_on(capsys, on_the_cpu):
    """On this CPU every real-size case is over a limit: each is a 'refused' line with the budget's one
    line (which option overrides it), none runs, and the bench ends with its summary, exit 1, no traceback. On the
    CPU by choice: gloo ranks, VDPCP_DEVICE unset (on a GPU these cases fit, and would run)."""
    from vdpcp.cli import main

    assert main(["bench", "towers", "--impl", "reference", "--cp", "2", "-k", "three-images-cp2-reference-count",
                 "--backend", "gloo"]) == 1
    out = capsys.readouterr().out.splitlines()
    refused = [text for text in out if "  refused  " in text]
    assert refused and len(refused) == sum(text.startswith("three-images-cp2-reference-count") for text in out)
    assert all("raise it with --max-" in text for text in refused)  # the override, never cut off
    assert out[-2] == (f"{len(refused)} refused before they ran: over this machine's memory or compute limit (their lines say "
                       "which, and the option that raises it)")
    assert out[-1].startswith(f"{len(refused)} cases, 0 passing")
