"""Matplotlib figures used by the notebooks (each with a title, axis labels and units)."""
