"""Tools built on the matrix: fuzz.py (random microbatches, shrunk to a saved case), capture.py (a training
step's microbatch saved for replay), mutants/ (planted bugs the matrix must kill), bench/ (benchmarks that print
figures) and ab/ (the feature's A/B training run).

Internal: vdpcp's own, free to change; what a user imports comes from ``vdpcp`` itself.
"""
