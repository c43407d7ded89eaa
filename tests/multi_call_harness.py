"""A multi-call harness for live fault tests: runs the toy harness (its path is the first
argument) ``calls`` times in a row on the same instructions, so an execution makes
several model calls and stays in flight for a while. Each run prints the toy harness's
summary line (its calls and retries) to stderr; the exit status is the first non-zero
one, else 0.

    python multi_call_harness.py TOY_HARNESS_PATH CALLS INSTRUCTIONS
"""

import subprocess
import sys

toy, calls, instructions = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for _ in range(calls):
    code = subprocess.run([sys.executable, toy, instructions], check=False).returncode
    if code != 0:
        sys.exit(code)
