"""Discrete-event simulation of the scheduler: virtual clock, workload models and traces."""
