"""isolate: replay under single repairs to find the operation the δ error starts in (paper §3.2).

One room per analysis: compute.py (numbers), table.py (rich tables, the report's sentence), figure.py (PNGs).
"""
