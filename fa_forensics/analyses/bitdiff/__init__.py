"""bitdiff: two O tensors of a dump compared bit by bit.

One room per analysis: compute.py (numbers), table.py (rich tables, the report's sentence), figure.py (PNGs).
"""
