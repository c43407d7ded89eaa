"""Cells, their placement (local processes or Ray actors) and weight transfer."""
