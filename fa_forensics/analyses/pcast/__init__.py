"""pcast: the FP8 P-cast study (paper 002): the kernel model, the simulation, the per-head dump study.

compute.py: the dump study; sim.py: the simulation; kernel.py, e4m3.py, theory.py: the kernel model, dp(S) and the
closed forms they share; table.py, figure.py: its tables (and the report's sentence) and PNGs.
"""
