#!/usr/bin/env bash
# The verifier: run in the working directory the harness left, after it ended.
set -u
if [[ ! -f hello.txt ]]; then
  echo "FAIL: hello.txt does not exist"
  exit 1
fi
if [[ "$(cat hello.txt)" != "Hello, world!" ]]; then
  echo "FAIL: hello.txt holds $(head -c 200 hello.txt | od -c | head -3)"
  exit 1
fi
echo "PASS: hello.txt says Hello, world!"
