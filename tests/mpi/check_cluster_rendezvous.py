"""Two hosts, one with a decoy interface (bench/cluster/harness.py): the store's address, its error.

Run by tests/test_cluster.py on 2 nodes x 1 rank. n0 (rank 0's host) has an
interface holding ``CLUSTER_DECOY``, an address in a subnet n1 has no route
to, ahead of ``eth0`` in interface order: the first address of
``hostname -I`` is the decoy. What a launch checks follows from its
environment:

- no override: ``import mpidp`` exports MASTER_ADDR = n0's address on the link
  to n1 (not the decoy, not 127.0.0.1) and ``master_address()`` says why;
- ``MPIDP_RDZV_IFACE=eth0``: the same address, chosen from the variable;
- in both: mpidp's store travels over MPI and opens no port on either host; a
  process outside the job on n1 tries every port rank 0's process listens on
  but the MPI library's (gloo's, once gloo runs) with torch's store client and
  junk: none answers as a store, and the job's sums stay right;
- in both: gloo and "mpidp" start from ``mpidp.init_process_group`` with none
  of MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE set by the launcher, an
  all_reduce crosses both hosts, ``dist.monitored_barrier`` passes over gloo
  and ``mpidp.monitored_barrier`` over "mpidp";
- ``MPIDP_RDZV_ADDR=<decoy>`` with ``MPIDP_STORE=tcp`` (the default store travels
  over MPI and needs no address): every rank raises ``DistNetworkError`` naming
  the address and port tried and the variables that change them; each rank
  prints it, then lets it through, so the job ends as a user's would (mpidp
  aborts it, status 1).

Rank 0 prints ``RDZV <check> ...`` lines; under the decoy every rank prints
``RDZV error rank R: <type>: <message>``.
"""

import os

GIVEN = sorted(name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if name in os.environ)  # before mpidp exports them

from mpi4py import MPI  # noqa: E402  (initialises MPI: its own ports open here)

from _ports import listening, outsider  # noqa: E402

LIBRARY = listening(os.getpid())  # the MPI library's ports, before mpidp runs

import datetime  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mpidp  # noqa: E402
from mpidp import rendezvous  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
DECOY = os.environ["CLUSTER_DECOY"]
GIVEN_ADDR = os.environ.get("MPIDP_RDZV_ADDR", "")
GIVEN_IFACE = os.environ.get("MPIDP_RDZV_IFACE", "")
TIMEOUT = datetime.timedelta(seconds=60)


def write(line: str) -> None:
    """``line`` in one write: with PYTHONUNBUFFERED, print's text and newline are two, and the
    launcher may put another rank's line between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say(line: str) -> None:
    if RANK == 0:
        write(f"RDZV {line}")


def check_the_hosts_and_the_trap() -> None:
    assert GIVEN == [], f"the launcher set {GIVEN}: this test needs none of them"
    assert COMM.allgather(socket.gethostname()) == [f"n{rank}" for rank in range(SIZE)]
    if RANK == 0:
        naive = subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                               check=True).stdout.split()
        assert naive[0] == DECOY, f"hostname -I lists {naive}: the decoy is not first"
        say(f"hostname-I {' '.join(naive)}")


def check_the_address() -> None:
    host, port, why = rendezvous.master_address()
    expected = socket.gethostbyname("n0")  # /etc/hosts: n0's address on the bridge
    assert host == expected != DECOY, (host, why)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (host, str(port))
    assert COMM.allgather((host, port)) == [(host, port)] * SIZE
    if GIVEN_IFACE:
        assert why == f"MPIDP_RDZV_IFACE={GIVEN_IFACE}", why
    else:
        assert why == f"interface eth0, on the link to n1 ({socket.gethostbyname('n1')})", why
    say(f"address MASTER_ADDR={host} MASTER_PORT={port} why={why}")


def check_backend(backend: str) -> None:
    mpidp.init_process_group(backend, timeout=TIMEOUT)
    try:
        tensor = torch.tensor([float(RANK + 1)])
        dist.all_reduce(tensor)
        assert tensor.item() == SIZE * (SIZE + 1) / 2, tensor
        if backend == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
        else:
            mpidp.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        say(f"backend {backend} all_reduce={tensor.item():g} monitored_barrier=passed")
    finally:
        dist.destroy_process_group()


def check_an_outsider_on_the_other_node() -> None:
    mpidp.init_process_group("mpidp", timeout=TIMEOUT)
    dist.distributed_c10d._get_default_store().set(f"in/{RANK}", "1")
    ours = listening(os.getpid()) - LIBRARY
    assert ours == set(), f"rank {RANK}: mpidp listens on {sorted(ours)}"
    dist.destroy_process_group()
    mpidp.init_process_group("gloo", timeout=TIMEOUT)
    try:
        host = socket.gethostbyname("n0")
        targets = sorted(f"{host if address in ('0.0.0.0', '::') else address}:{port}"
                         for address, port in listening(os.getpid()) - LIBRARY)
        targets = COMM.bcast(targets if RANK == 0 else None, root=0)  # rank 0's, from n1
        if RANK == 1:
            tried = outsider(targets)
            assert "accepted" not in tried, tried
            write(f"RDZV outsider on n1 tried {len(targets)} ports of rank 0 (gloo's): "
                  f"{'; '.join(tried.splitlines())}")
        COMM.Barrier()
        tensor = torch.tensor([float(RANK + 1)])
        dist.all_reduce(tensor)
        assert tensor.item() == SIZE * (SIZE + 1) / 2, tensor
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
        say(f"outsider accepted none; mpidp ports none; library ports {sorted(LIBRARY)}")
    finally:
        dist.destroy_process_group()


def check_the_unreachable_address() -> None:
    host, port, why = rendezvous.store_address()
    assert (host, why) == (GIVEN_ADDR, "MPIDP_RDZV_ADDR"), (host, why)
    try:
        mpidp.init_process_group("gloo", timeout=TIMEOUT)
    except Exception as error:
        write(f"RDZV error rank {RANK}: {type(error).__name__}: {error}")
        assert isinstance(error, dist.DistNetworkError), type(error)
        text = str(error)
        for part in (f"{host}:{port}", "MPIDP_RDZV_ADDR", "MPIDP_RDZV_IFACE",
                     "MPIDP_RDZV_TIMEOUT"):
            assert part in text, f"{part!r} not in the error"
        COMM.Barrier()  # every rank has printed its line before the abort below
        raise
    raise AssertionError(f"rank {RANK} reached {host}:{port}, which it should not")


def main() -> None:
    check_the_hosts_and_the_trap()
    if GIVEN_ADDR:
        check_the_unreachable_address()
        return
    check_the_address()
    for backend in ("gloo", "mpidp"):
        check_backend(backend)
    check_an_outsider_on_the_other_node()
    say("done")


if __name__ == "__main__":
    main()
