"""The correctness matrix and its verdicts.

scenarios.py the matrix as data (named microbatches, CP sizes, layouts); case.py one case and one rank's result;
budget.py what a case needs before it runs; runner.py runs a case on its ranks; expectations.py judges it: the
one place a verdict is decided; report.py and progress.py what a run prints and leaves behind; saved.py a case
saved to a file.

Internal: vdpcp's own, free to change; what a user imports comes from ``vdpcp`` itself.
"""
