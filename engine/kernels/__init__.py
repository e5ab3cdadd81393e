"""The Python face of every kernel: packed cache records, paged gathers and attention (torch references)."""
