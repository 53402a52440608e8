"""Kernel development: the paged-attention bench, Mosaic GPU probes and trace tools, the Mosaic
decode kernel the engine does not select, and the notes of every kernel session (NOTES.md)."""
