"""Analyses: pure functions from a dump selection (or tensors) to frozen dataclasses of numbers.

An analysis never prints, plots or reads argv. Figures take its results; the CLI wires them.
"""
