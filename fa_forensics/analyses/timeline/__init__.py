"""timeline: the training-time view of a monitored run (paper Fig. 2, 3, 11, 13).

One room per analysis: compute.py (numbers), table.py (rich tables), figure.py (PNGs).
"""
