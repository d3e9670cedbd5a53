"""Figures: matplotlib, one function per figure, taking analysis results (never raw argv)."""
