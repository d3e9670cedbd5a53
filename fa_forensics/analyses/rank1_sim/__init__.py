"""rank1-sim: the similar rank-1 matrices behind the biased W_Q update (paper §3.3.1, Fig. 4).

One room per analysis: compute.py (numbers), table.py (rich tables, the report's sentence), figure.py (PNGs).
"""
