"""Fidelity: whether a replay recipe computes what the training kernel computed (match, the recipes a dump
allows, the `auto` recipe resolved once, the mismatch test)."""
