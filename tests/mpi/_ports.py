"""The TCP ports a process listens on, and an outsider that tries each one as a store client.

Imports nothing of mpidp's or MPI's: a check file reads the MPI library's own ports
with ``listening`` before it imports mpidp.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

_OUTSIDER = r"""
import datetime, os, socket, sys, threading
import torch.distributed as dist
results = {}
def client(where):
    host, port = where.rsplit(":", 1)
    try:
        store = dist.TCPStore(host, int(port), None, False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=2))
        store.set("outsider", "1")
        results[where] = f"accepted a store client (num_keys {store.num_keys()})"
    except Exception as error:
        results[where] = f"refused ({type(error).__name__})"
threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in sys.argv[1:]]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(2)
for where in sys.argv[1:]:
    host, port = where.rsplit(":", 1)
    try:  # 4 KiB of junk too
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            sock.sendall(os.urandom(4096))
    except OSError:
        pass
    print(where, results.get(where, "no store answered within 2 s"), flush=True)
os._exit(0)
"""


def _address(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                host, port = fields[1].split(":")
                found.add((_address(host), int(port, 16)))
    return found


def outsider(targets: list[str]) -> str:
    """A process outside the job (no MPI variables) tries torch's store client and junk on each
    ``host:port``; one line per target: "accepted ...", "refused (...)" or "no store answered"."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI", "HYDRA", "MPI", "OMPI", "PMIX", "PRTE"))}
    done = subprocess.run([sys.executable, "-c", _OUTSIDER, *targets], env=env, timeout=120,
                          capture_output=True, text=True)
    if done.stdout.count("\n") != len(targets):
        raise AssertionError(f"the outsider did not try every port:\n{done.stdout}{done.stderr}")
    return done.stdout
