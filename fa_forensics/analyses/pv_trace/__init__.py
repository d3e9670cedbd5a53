"""pv-trace: the error of one P̄V dot product down to the bits (paper Eq. 4-5, Fig. 6).

One room per analysis: compute.py (numbers), table.py (rich tables, the report's sentence), figure.py (PNGs).
"""
