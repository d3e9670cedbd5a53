"""fa_forensics.numerics"""
