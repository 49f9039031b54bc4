"""Benchmarks behind `vdpcp bench TARGET`: each prints figures; none asserts a time.

A target module defines ``add_arguments(parser)`` and ``run(args) -> int``, and imports nothing heavy
at module level (the CLI imports every target to build its help).
"""
