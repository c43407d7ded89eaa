#!/usr/bin/env bash
# Terminal-Bench 1 layout: run the task's pytest file from $TEST_DIR.
python -m pytest -rA -p no:cacheprovider "$TEST_DIR/test_outputs.py"
