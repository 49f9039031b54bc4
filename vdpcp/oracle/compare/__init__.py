"""How the oracle compares a sharded run with the unsharded one: the tolerance model (precision.py), a case's own
rounding measured below float64 (rounding.py), the regrouped exact reference (regrouped.py) and the deterministic
algorithms it needs (determinism.py), the gradient checks
(gradients.py), whose loss weights and rows a rank owns (weights.py), and count sketches of a real-size tower's
parameter gradients (sketch.py).

Internal: vdpcp's own, free to change; what a user imports comes from ``vdpcp`` itself.
"""
