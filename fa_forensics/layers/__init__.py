"""Layers: loading a layer-step of a dump for the analyses (selection, the checks every load runs, finiteness,
fan-out over workers)."""
