"""fix-check: whether the stabilized softmax removes the bias (paper §4, App. C).

One room per analysis: compute.py (numbers), table.py (rich tables), figure.py (PNGs).
"""
