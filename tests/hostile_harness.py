"""A hostile harness (run by tests/test_sandbox_hostile.py; standard library only).

``python hostile_harness.py TARGETS_JSON INSTRUCTIONS`` makes one model call through its
base URL, as a harness should, then tries every way out it knows of, printing one line
``<attempt> yes|no <detail>`` each: ``yes`` means the attempt got what it wanted. The
paths, pids and ports to go after come in the targets file, and the attempts to skip
(``skip``: unconfined, remounting or unmounting would change the machine itself).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

SKIP: list[str] = []


def attempt(name: str, action: Callable[[], object]) -> None:
    if name in SKIP:
        print(f"{name} skipped", flush=True)
        return
    try:
        got = action()
    except Exception as exc:  # the attempt failed: that is what the sandbox is for
        print(f"{name} no {type(exc).__name__}: {str(exc)[:120]!r}", flush=True)
        return
    print(f"{name} {'yes' if got else 'no'} {str(got)[:120]!r}", flush=True)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(64)


def model_call() -> int:
    body = {
        "model": "qwengyre",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        # a key stolen from elsewhere: the relay puts the execution's own in its place
        headers={"content-type": "application/json", "authorization": "Bearer qg-stolen"},
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return answer.status == 200


def remount_and_write(target: str) -> bool:
    subprocess.run(["mount", "-o", "remount,bind,rw", "/"], capture_output=True, check=False)
    with open(target, "w") as f:
        f.write("planted")
    return True


def unmount_and_read(hidden: list[str], store: str) -> bytes:
    for path in hidden:
        subprocess.run(["umount", "-l", path], capture_output=True, check=False)
    return read(store)


def keys_in_environs() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                environ = read_all(f"/proc/{pid}/environ")
            except OSError:
                continue
            found += [v for v in environ.split(b"\0") if b"=qg-" in v]
    return [f.decode(errors="replace") for f in found]


def read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def forks(most: int) -> int:
    """How many children (each sleeping a minute) it could fork, up to ``most``."""
    made = 0
    for _ in range(most):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
    return made


def allocate(mb: int) -> bool:
    code = f"x = bytearray({mb} * 2**20); x[::4096] = b'1' * len(x[::4096]); print('held')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    return done.returncode == 0


def connect(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=5):
        return True


def others(directory: str, own: str) -> list[str]:
    return [name for name in os.listdir(directory) if name != own]


def main() -> None:
    targets = json.loads(read_all(sys.argv[1]))
    SKIP.extend(targets.get("skip", []))
    own = os.environ["QWENGYRE_EXECUTION_ID"]
    print(f"execution {own}", flush=True)
    attempt("model_call", model_call)
    attempt("read_store", lambda: read(targets["store"]))
    attempt("other_workspaces", lambda: others(targets["workspaces"], own))
    attempt("other_logs", lambda: others(targets["logs"], own))
    attempt("read_checkpoint", lambda: read(targets["checkpoint"]))
    attempt("other_run_store", lambda: read(targets["other_store"]))
    attempt("remount_write", lambda: remount_and_write(targets["plant"]))
    attempt("unmount_read", lambda: unmount_and_read(targets["hidden"], targets["store"]))
    attempt("operator_credentials", lambda: read(targets["credentials"]))
    attempt("environ_keys", keys_in_environs)
    attempt("signal_outside", lambda: os.kill(targets["victim"], signal.SIGTERM) or True)
    attempt("weight_board", lambda: read(targets["board"]))
    attempt("host_sockets", lambda: [n for n in os.listdir("/run") if n != "qwengyre"])
    attempt("loopback_listener", lambda: connect("127.0.0.1", targets["port"]))
    attempt("other_loopback", lambda: connect("127.0.0.2", targets["port"]))
    attempt("outside_address", lambda: connect("1.1.1.1", 53))
    attempt("memory", lambda: allocate(targets["memory_mb"] * 2))
    attempt("fork_bomb", lambda: forks(targets["processes"]) >= targets["processes"])


if __name__ == "__main__":
    main()
