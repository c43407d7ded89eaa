"""The live runtime: the controller that drives the scheduler for real (with its observer
and supervisor), the ready-group ledger, the run-directory lock and the live view."""
