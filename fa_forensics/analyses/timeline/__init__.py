"""timeline: the training-time view of a monitored run (paper Fig. 2, 3, 11, 13).

compute.py gives the numbers, figure.py the PNGs (the table is built by the command).
"""
