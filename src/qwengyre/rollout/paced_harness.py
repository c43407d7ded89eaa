"""A paced harness: a fixed number of model calls with a pause after each, so that a
run's executions are really in flight for a while (controller-restart tests and
benchmarks). Standard library only: run it by its path,
``python .../paced_harness.py INSTRUCTIONS [CALLS [PAUSE_S]]``, even where the harness's
environment cannot import qwengyre.

It speaks OpenAI chat completions (``OPENAI_BASE_URL`` ending in ``/v1``,
``OPENAI_API_KEY``) and retries a call that fails for want of a proxy or an engine (a
refused connection, a reset, a 5xx or a 429) every half second for up to
:data:`RETRY_FOR_S`, as real clients ride out a controller restart. In its working
directory it appends its pid to ``starts`` when it starts and an ``x`` to ``calls``
after each answered call. Exit status 0 once every call was answered.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

RETRY_FOR_S = 300.0


def call(url: str, headers: dict[str, str], body: bytes) -> dict[str, object]:
    """One answered call's reply message, retried as the module docstring says."""
    give_up = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            request = urllib.request.Request(url, body, headers)
            with urllib.request.urlopen(request, timeout=120) as response:
                message: dict[str, object] = json.load(response)["choices"][0]["message"]
                return message
        except OSError as exc:  # refused, reset, HTTP errors (HTTPError is an OSError)
            code = getattr(exc, "code", 500)
            if (code < 500 and code != 429) or time.monotonic() > give_up:
                raise
            time.sleep(0.5)


def main(argv: list[str]) -> int:
    instructions = argv[0]
    calls = int(argv[1]) if len(argv) > 1 else 4
    pause_s = float(argv[2]) if len(argv) > 2 else 1.0
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    headers = {
        "authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "content-type": "application/json",
    }
    with open("starts", "a") as f:
        f.write(f"{os.getpid()}\n")
    messages: list[dict[str, object]] = [{"role": "user", "content": instructions}]
    for _ in range(calls):
        body = json.dumps({"model": "m", "messages": messages, "max_tokens": 8}).encode()
        reply = call(url, headers, body)
        with open("calls", "a") as f:
            f.write("x")
        messages += [
            {"role": "assistant", "content": reply.get("content") or ""},
            {"role": "user", "content": "Go on."},
        ]
        time.sleep(pause_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
