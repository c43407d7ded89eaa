"""Training: chunked current log-probs and the execution-level objective (docs/design.md §2)."""
