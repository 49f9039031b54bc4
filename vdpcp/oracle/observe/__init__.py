"""What the oracle observes of a run, beside its outputs: which rows reached each tower (reads.py), what ran
(execution.py), how the work was split (split.py), host-to-device copies (traffic.py), the gradient handed each
output's backward (handed.py), each rank's load against its declared objective (declared_balance.py), the
collectives that stood in for torch's on gloo (gloo_collectives.py), and time and memory (telemetry.py).

Internal: vdpcp's own, free to change; what a user imports comes from ``vdpcp`` itself.
"""
