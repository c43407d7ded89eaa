"""Training: chunked current log-probs and the execution-level objective (DESIGN.md §2)."""
