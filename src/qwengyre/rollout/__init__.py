"""Rollout: tasks, executions, harnesses, evaluation, groups."""
