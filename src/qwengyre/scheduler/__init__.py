"""The elastic scheduler: a pure, deterministic state machine (events in, actions out)."""
