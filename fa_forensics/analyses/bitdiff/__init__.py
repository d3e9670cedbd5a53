"""bitdiff: two O tensors of a dump compared bit by bit.

One room per analysis: compute.py (numbers), table.py (rich tables), figure.py (PNGs).
"""
