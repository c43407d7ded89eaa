"""A stand-in for the ``sglang`` package, on ``PYTHONPATH`` in tests only: its
``launch_server`` serves qwengyre's own engine behind SGLang's HTTP API (SGLang's
kernels need CUDA; the machines that run the tests have none)."""
