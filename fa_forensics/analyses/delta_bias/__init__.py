"""delta-bias: the sign and origin of Σ_T(δ_lp − δ_hp) (paper §3.3.1-3.3.2, Fig. 5).

One room per analysis: compute.py (numbers), table.py (rich tables, the report's sentence), figure.py (PNGs).
"""
