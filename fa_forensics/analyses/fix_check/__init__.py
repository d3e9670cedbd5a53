"""fix-check: whether the stabilized softmax removes the bias (paper §4, App. C).

One room per analysis: compute.py (numbers), table.py (rich tables, the report's sentence), figure.py (PNGs).
"""
