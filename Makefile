.PHONY: install lint format test bench

install:
	pip install torch==2.13.0 -e '.[dev]'

lint:
	ruff check src tests benchmarks
	ruff format --check src tests benchmarks
	mypy

format:
	ruff check --fix src tests benchmarks
	ruff format src tests benchmarks

test:
	python -m pytest -n 2 -q

bench:
	python benchmarks/bench_simulator.py
	python benchmarks/bench_proxy.py
	python benchmarks/bench_engine.py
