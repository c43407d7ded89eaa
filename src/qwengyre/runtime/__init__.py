"""The live runtime: the controller that drives the scheduler for real, and `qwengyre train`."""
