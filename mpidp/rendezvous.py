"""Starting any torch.distributed backend from MPI: ranks, a shared store and the usual variables.

Under ``mpiexec``/``srun`` MPI already knows every rank, so nothing needs to be
configured by hand::

    mpidp.init_process_group()            # "mpidp"; "cpu:gloo,cuda:nccl" with a GPU per rank
    mpidp.init_process_group("gloo")      # or "nccl", "mpidp", "cpu:gloo,cuda:nccl", ...

**The store.** By default ``mpidp.store.MPIStore``: rank 0 holds the keys and the
other ranks' operations travel over MPI on the store's own communicator, so only the
job reaches it and no port is opened (docs/security.md). Rank 0 answers from a thread
of its own, which needs ``MPI_THREAD_MULTIPLE``; below it the default is the TCP store.
``store="tcp"`` (``MPIDP_STORE=tcp``) keeps torch's ``TCPStore``, for processes outside
MPI (a framework's launcher agent): rank 0 starts its server at import, bound to one
address of its host that the other nodes reach (``mpidp.address``: ``127.0.0.1`` when
every rank shares the host; ``MPIDP_RDZV_ADDR``/``MPIDP_RDZV_IFACE`` override it), on a
port the system picks, and MPI broadcasts both. The other ranks connect at the first
rendezvous, within ``MPIDP_RDZV_TIMEOUT`` seconds, or every rank raises an error naming
the address, the port and the variables that change them. Each rendezvous gets a fresh
key prefix. ``store="local"`` (``MPIDP_STORE=local``): a process-local ``HashStore``, for
``"mpidp"`` alone (no ``monitored_barrier``, ``TORCH_DIST_INIT_BARRIER=1``, gloo, NCCL).

**The variables.** At import, mpidp exports RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, LOCAL_SIZE, GROUP_RANK, NODE_RANK, GROUP_WORLD_SIZE,
ROLE_RANK, ROLE_WORLD_SIZE (from MPI: the local ranks are those that share
memory), MASTER_ADDR and MASTER_PORT, so code written for ``torchrun`` runs
under ``mpiexec``. MASTER_ADDR is the address chosen above; MASTER_PORT is the
TCP server's port, or, with the store over MPI, a port that was free on that
address at import (nothing listens there: a program that starts its own
``TCPStore`` on it, as under ``torchrun``, can). torch's ``env://``
rendezvous (its default) then uses mpidp's store instead of starting a
server on rank 0: mpidp replaces torch's ``env://`` handler with one that does
so while MASTER_ADDR and MASTER_PORT are mpidp's, and hands anything else to
torch's. A user's own MASTER_ADDR or MASTER_PORT is left alone, and so is
``env://``. ``MPIDP_EXPORT_ENV=0`` exports nothing and starts no server at
import.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import time
from urllib.parse import parse_qs, urlencode, urlparse

import torch
import torch.distributed as dist
from mpi4py import MPI

from . import settings, address as _address, runtime, store as _store
from .backend_choice import MPIDP as _MPIDP, backend_for, default_backend
from . import watchdog as _watchdog
from .comm import agreement
from .comm.handle import collective

__all__ = ["backend_for", "default_backend", "init_process_group", "handler", "start_up", "store_address",
           "exported", "store_kind"]

SCHEME = "mpidp"
_STORES = ("mpi", "tcp", "local")
_OVERRIDE = "set MPIDP_RDZV_ADDR to an address of rank 0's host that every rank reaches, or " \
            "MPIDP_RDZV_IFACE to its interface (e.g. ib0); MPIDP_RDZV_TIMEOUT is the time allowed"

# torch.distributed re-exports a function named rendezvous over the module's name
_torch_rdzv = importlib.import_module("torch.distributed.rendezvous")
_torch_env_handler = _torch_rdzv._rendezvous_handlers["env"]


class _State:
    server = None     # rank 0: the TCPStore that holds the server (MPIDP_STORE=tcp)
    listener = None   # rank 0: its socket, bound to the one address (the server serves on it)
    address = None    # (host, port, why) of the server, on every rank; None: no server
    listened_at_import = False  # whether import mpidp started a TCP server (MPIDP_STORE=tcp)
    master = None     # (host, port, why) exported as MASTER_ADDR/PORT; None: none exported
    problem = None    # why there is no server or address (the same on every rank)
    client = None     # this rank's connection to the TCP server, made at the first rendezvous
    mpi_store = None  # the MPIStore under every rendezvous over MPI (MPIDP_STORE=mpi)
    count = 0         # rendezvous so far: each gets its own key prefix
    exported: dict[str, str] = {}


_state = _State()


def exported() -> dict[str, str]:
    """The variables mpidp exported at start-up (empty if it exported none)."""
    return dict(_state.exported)


def store_address() -> tuple[str, int, str] | None:
    """(address, port, why that address) of the TCP store's server; None if none runs.

    With the default store (over MPI) no server runs: ``master_address()``
    is then what MASTER_ADDR and MASTER_PORT say.
    """
    return _state.address


def master_address() -> tuple[str, int, str] | None:
    """(MASTER_ADDR, MASTER_PORT, why that address) as exported at import; None if not."""
    return _state.master


def store_kind() -> str:
    """The store ``mpidp.init_process_group`` uses by default: "mpi", "tcp" or "local"."""
    return _store_kind(None)


# -- start-up: the server and the variables ---------------------------------------------------

def _node_rank(world: MPI.Intracomm) -> tuple[int, int]:
    """(this node's index, number of nodes): nodes numbered by their lowest world rank."""
    first = runtime.local_rank() == 0
    leaders = collective(world, "allgather", (world.Get_rank() if first else None,),
                         "import mpidp: the nodes' first ranks (allgather)")
    starts = [rank for rank in leaders if rank is not None]
    mine = collective(runtime._node_comm(), "bcast", (world.Get_rank() if first else None, 0),
                      "import mpidp: this node's first rank (broadcast)")
    return starts.index(mine), len(starts)


def _choose(world: MPI.Intracomm) -> tuple[str, str]:
    """Rank 0's address for the store and why (collective; runs only on rank 0's side)."""
    mine = (None if runtime.local_rank() or world.Get_rank() == 0 else
            (socket.gethostname(), [a for a, _ in _address.interfaces().values()]))
    reports = collective(world, "gather", (mine, 0), "import mpidp: the nodes' addresses (gather)")
    if world.Get_rank() != 0:
        return "", ""
    peers = [report for report in reports if report is not None]
    given = settings.get("MPIDP_RDZV_ADDR")
    if given:
        return _address.given_address(given), "MPIDP_RDZV_ADDR"
    interface = settings.get("MPIDP_RDZV_IFACE")
    if interface:
        return _address.interface_address(interface), f"MPIDP_RDZV_IFACE={interface}"
    if runtime.local_size() == world.Get_size():
        return "127.0.0.1", "every rank runs on rank 0's host"
    return _address.choose(_address.interfaces(), peers)


def _bound_socket(host: str, listen: bool) -> socket.socket:
    """A TCP socket bound to ``host`` alone (never every interface) on a port the OS picks."""
    family, kind, proto, _, where = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(where)
        if listen:
            sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def _start_server(world: MPI.Intracomm, listen: bool = True) -> tuple[str, int, str] | None:
    """Rank 0 starts the TCP store's server on its one address; every rank learns where (collective).

    Without ``listen`` rank 0 only picks the address and a port that is free
    now, for MASTER_ADDR and MASTER_PORT (the store travels over MPI), and
    starts nothing. Returns (address, port, why), or None with
    ``_state.problem`` set, on every rank.
    """
    found = host = None
    try:
        host, why = _choose(world)
        if world.Get_rank() == 0:
            sock = _bound_socket(host, listen)
            port = sock.getsockname()[1]
            if listen:  # torch's server takes the socket: it serves on this address alone
                _state.server = dist.TCPStore(
                    host, port, None, True, wait_for_workers=False, multi_tenant=True,
                    master_listen_fd=sock.fileno(),
                    timeout=datetime.timedelta(seconds=_connect_seconds()))
                _state.listener = sock
            else:
                sock.close()
            found = (host, port, why)
    except Exception as error:  # noqa: BLE001  every rank must hear of it
        where = f" on {host} (chosen from {why})" if host else ""
        found = f"{where}: {type(error).__name__}: {error}"
    found = collective(world, "bcast", (found, 0), "import mpidp: the rendezvous address (broadcast)")
    if isinstance(found, str):
        what = "start the rendezvous store" if listen else "choose the rendezvous address"
        _state.problem = f"rank 0 could not {what}{found}"
        return None
    if listen:
        _state.address = found
    return found


def _export(world: MPI.Intracomm) -> None:
    node, nodes = _node_rank(world)
    rank, size = str(world.Get_rank()), str(world.Get_size())
    local, local_size = str(runtime.local_rank()), str(runtime.local_size())
    values = dict(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=local, LOCAL_WORLD_SIZE=local_size,
                  LOCAL_SIZE=local_size, GROUP_RANK=str(node), NODE_RANK=str(node),
                  GROUP_WORLD_SIZE=str(nodes), ROLE_RANK=rank, ROLE_WORLD_SIZE=size)
    if _state.master is not None:
        values.update(MASTER_ADDR=_state.master[0], MASTER_PORT=str(_state.master[1]))
    os.environ.update(values)
    _state.exported = values
    if _state.master is not None:  # env:// now means mpidp's store
        _torch_rdzv._rendezvous_handlers["env"] = _env_handler


def start_up(force: bool = False) -> None:
    """Make the MPI store's communicator and export the variables (collective; at ``import mpidp``).

    Does nothing with one rank unless ``force`` (``python -m mpidp run`` forces
    it), or when it already ran; exports nothing under ``MPIDP_EXPORT_ENV=0``.
    Under ``MPIDP_STORE=tcp`` it starts the TCP store's server on rank 0. When
    the user set MASTER_ADDR or MASTER_PORT, both are left as they are (and no
    server starts).
    """
    world = MPI.COMM_WORLD
    if not _state.exported and not (world.Get_size() == 1 and not force):
        export, kind = _agreed_start(world)
        _store.start(world)  # collective: the MPI store's communicator, whatever the store
        if not export:
            return
        if kind in ("tcp", "mpi"):
            _state.master = _start_server(world, listen=kind == "tcp")
            _state.listened_at_import = _state.address is not None
        _export(world)
    if force and _state.problem is not None:
        # python -m mpidp run exists for programs that read MASTER_ADDR: without this
        # they would only hear torch's "MASTER_ADDR expected, but not set" (the same
        # problem on every rank: rank 0 broadcast it)
        raise dist.DistNetworkError(f"mpidp rendezvous: {_state.problem}; {_OVERRIDE}")


def _agreed_start(world: MPI.Intracomm) -> tuple[bool, str | None]:
    """(export the variables, the store to prepare: "tcp", "mpi" or None), the same on every
    rank, or the same error.

    Each rank reads MPIDP_EXPORT_ENV, MPIDP_STORE and whether the user set
    MASTER_ADDR or MASTER_PORT; what follows from them is collective (the
    server's address is gathered and broadcast), so a rank that read them
    otherwise would leave the others waiting in it for good (seen: import
    mpidp hung with MPIDP_STORE=local or MASTER_PORT on one rank only). One
    small allgather at import compares them first.
    """
    try:
        export = settings.get("MPIDP_EXPORT_ENV")
        kind = _store_kind(None)
        mine = (f"MPIDP_EXPORT_ENV={'1' if export else '0'}, MPIDP_STORE={kind}, "
                f"MASTER_ADDR {'set' if settings.given('MASTER_ADDR') else 'unset'}, "
                f"MASTER_PORT {'set' if settings.given('MASTER_PORT') else 'unset'}")
        problem = None
    except ValueError as error:
        export, kind, mine, problem = False, "", "", str(error)
    agreement.decide(world, (mine, problem), _alike(
        "import mpidp:", "MPIDP_EXPORT_ENV, MPIDP_STORE, MASTER_ADDR and MASTER_PORT must be set "
        "alike on every rank (together they decide whether import mpidp starts the rendezvous "
        "store, which every rank takes part in)"),
        "import mpidp: the rendezvous settings of every rank")
    user_master = settings.given("MASTER_ADDR") or settings.given("MASTER_PORT")
    return export, (kind if export and not user_master else None)


# -- the rendezvous -----------------------------------------------------------------------------

def _connect_seconds() -> float:
    return settings.get("MPIDP_RDZV_TIMEOUT")


def _store_kind(given: str | None) -> str:
    """The store asked for, else ``MPIDP_STORE``, else "mpi" (needs MPI_THREAD_MULTIPLE, else "tcp")."""
    default = "mpi" if runtime.thread_level() >= MPI.THREAD_MULTIPLE else "tcp"
    kind = (given or settings.get("MPIDP_STORE") or default).lower()
    if kind not in _STORES:
        raise ValueError(f"store must be one of {', '.join(_STORES)}, got {given!r}")
    return kind


def _mpi_store() -> dist.Store:
    """The store over MPI that every rendezvous shares (rank 0's thread starts with it)."""
    if _state.mpi_store is None:
        _state.mpi_store = _store.MPIStore(datetime.timedelta(seconds=_connect_seconds()))
    return _state.mpi_store


def _reach(host: str, port: int, seconds: float) -> str | None:
    """None once a TCP connection to host:port opens within ``seconds``, else why not."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic())):
                return None
        except OSError as error:
            if time.monotonic() >= deadline:
                return f"{type(error).__name__}: {error}"
            time.sleep(0.1)


def _shared_store() -> dist.Store:
    """This rank's connection to the TCP store's server (collective at the first call)."""
    if _state.client is not None:
        return _state.client
    world = runtime.world()  # the survivors after a heal
    if _state.address is None and _state.problem is None:
        _start_server(world)  # export turned off, or a rendezvous without mpidp's start-up
    problem = _state.problem
    if problem is None and world.Get_rank() != 0:
        host, port, why = _state.address
        seconds = _connect_seconds()
        failure = _reach(host, port, seconds)
        if failure is None:
            try:
                _state.client = dist.TCPStore(host, port, None, False, wait_for_workers=False,
                                              timeout=datetime.timedelta(seconds=seconds))
            except Exception as error:  # noqa: BLE001
                failure = f"{type(error).__name__}: {error}"
        if failure is not None:
            problem = (f"could not connect to the rendezvous store at {host}:{port} (rank 0's "
                       f"address, chosen from {why}) within {seconds:g} s ({failure}); {_OVERRIDE}")
    elif problem is None:
        _state.client = _state.server
    agreement.raise_together(world, problem, dist.DistNetworkError, "mpidp rendezvous:",
                             "mpidp rendezvous (connecting to the store)")
    return _state.client


def _ranks(query: dict) -> tuple[int, int]:
    runtime.require_mpi()
    world = runtime.world()  # the survivors after a heal: the backend's default group's ranks
    rank, size = world.Get_rank(), world.Get_size()
    for name, actual in (("rank", rank), ("world_size", size)):
        if name in query and int(query[name]) not in (-1, actual):
            raise ValueError(f"init_process_group: {name}={query[name]} disagrees with MPI, "
                             f"which gives this process {name} {actual}; leave {name} out "
                             f"(the rendezvous takes it from MPI)")
    return rank, size


def handler(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs):
    """torch's rendezvous handler for ``mpidp://[?store=mpi|tcp|local]``: MPI's ranks, mpidp's store."""
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    rank, size = _ranks(query)
    kind = _store_kind(query.get("store"))
    if kind == "local":
        store = dist.HashStore()
    else:
        shared = _mpi_store() if kind == "mpi" else _shared_store()
        store = dist.PrefixStore(f"mpidp/{_state.count}", shared)
        _state.count += 1
    if timeout is not None:
        store.set_timeout(timeout)
    yield store, rank, size
    raise RuntimeError("the mpidp rendezvous cannot be repeated: MPI's ranks are fixed")


def _env_handler(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs):
    """``env://`` while MASTER_ADDR and MASTER_PORT are mpidp's: its store; else torch's own."""
    ours = all(os.environ.get(name) == _state.exported.get(name)
               for name in ("MASTER_ADDR", "MASTER_PORT"))
    if not ours or MPI.Is_finalized():
        return (yield from _torch_env_handler(url, timeout, **kwargs))
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    for name, variable in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        query.setdefault(name, os.environ.get(variable, "-1"))
    return (yield from handler(f"{SCHEME}://?{urlencode(query)}", timeout, **kwargs))


def _backends(backend: str) -> set[str]:
    return {part.split(":")[-1].strip().lower() for part in str(backend).split(",")}


def _init_problem(backend: str, store, kwargs: dict) -> str | None:
    """What is wrong with these init_process_group arguments on this rank (None: nothing)."""
    try:
        if store is not None and not isinstance(store, str):
            return None
        kind = _store_kind(store)
        if _MPIDP in _backends(backend) and len(_backends(backend)) > 1:
            return (f"backend {backend!r}: torch makes a Python process group such as 'mpidp' "
                    f"the group of every device of a device map and drops the other backends; "
                    f"use 'mpidp' alone (CUDA tensors then go through MPI) or a map without it, "
                    f"e.g. 'cpu:gloo,cuda:nccl'")
        if kind == "local" and _backends(backend) != {_MPIDP}:
            return (f"store='local' works for the 'mpidp' backend alone (each rank's store is "
                    f"its own), got backend {backend!r}; use store='mpi'")
        if kind == "mpi" and runtime.thread_level() < MPI.THREAD_MULTIPLE:
            return (f"store='mpi' needs MPI_THREAD_MULTIPLE (rank 0 serves it from a thread), "
                    f"but MPI granted {runtime.thread_level_name(runtime.thread_level())}; "
                    f"use store='tcp'")
        method = kwargs.get("init_method")
        if store is not None and method is not None and method != f"{SCHEME}://?store={kind}":
            return f"give store= or init_method=, not both (got {method!r})"
        _ranks({name: kwargs[name] for name in ("rank", "world_size") if name in kwargs})
    except (ValueError, TypeError) as error:
        return str(error).removeprefix("init_process_group: ")
    return None


def _agree_on_init(backend: str, store, kwargs: dict) -> None:
    """The same arguments on every rank, each valid, or the same ValueError on every rank.

    Checked before anything collective: a backend, store or init_method that
    differs on one rank (or a bad value there) otherwise left the other ranks
    waiting in the rendezvous or the backend's start-up until the watchdog or
    the store's timeout, or ended in MPI's "Message truncated".
    """
    runtime.require_mpi()
    world = runtime.world()  # the survivors after a heal
    if world.Get_size() == 1:
        problem = _init_problem(backend, store, kwargs)
        if problem is not None:
            raise ValueError(f"init_process_group: {problem}")
        return
    store_text = store if store is None or isinstance(store, str) else type(store).__name__
    mine = (f"backend={backend!r}, store={store_text!r}, "
            f"init_method={kwargs.get('init_method')!r}")
    every = agreement.decide(
        world, (mine, _init_problem(backend, store, kwargs), _state.count),
        _alike("init_process_group:",
               "every rank must pass the same backend, store and init_method"),
        "init_process_group: the arguments of every rank")
    # each rendezvous takes the next key prefix; an init that failed on one rank after
    # its rendezvous (caught, then retried) must not leave the ranks' prefixes apart
    _state.count = max(fact[2] for fact in every)


def _alike(what: str, rule: str):
    """The ``agreement.decide`` judge of facts ``(setting, problem, ...)``: each rank's problem
    if any rank has one, else ``rule`` broken where the settings differ (``ValueError``)."""
    def judge(facts: list):
        problems = [fact[1] for fact in facts]
        if any(problems):
            return ValueError(f"{what} {agreement.by_rank(problems)}")
        settings_of = [fact[0] for fact in facts]
        if len(set(settings_of)) > 1:
            return ValueError(f"{what} {rule}; got {agreement.by_rank(settings_of)}")
        return None
    return judge


def with_group_timeout(backend: str, kwargs: dict) -> dict:
    """``kwargs`` with gloo's and NCCL's group timeout set to the stall watchdog's, if not given.

    The watchdog sees mpidp's own collectives only. A gloo or NCCL collective whose peer
    never comes raises after its group's timeout (torch's default: 30 minutes for gloo),
    and the raise ends the job (``mpidp.runtime``). With the watchdog's timeout
    (``MPIDP_TIMEOUT``, ``mpidp.watchdog.set_timeout``) such a job ends as soon as an mpidp
    stall would, though without the stall summary that names each rank. Under
    ``MPIDP_TIMEOUT_ACTION=report``, or with the watchdog off, torch's default stays.
    """
    seconds, action = _watchdog.get_timeout()
    if "timeout" in kwargs or backend == "mpidp" or not seconds or action != "abort":
        return kwargs
    return {**kwargs, "timeout": datetime.timedelta(seconds=seconds)}


def init_process_group(backend: str | None = None, *, store=None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` for any backend, ranks and store from MPI.

    Args:
        backend: ``"mpidp"``, ``"gloo"``, ``"nccl"`` or a device map such as
            ``"cpu:gloo,cuda:nccl"`` (not one with "mpidp" and another backend,
            see ``backend_for``); None: ``default_backend()`` (NCCL where each
            rank has a GPU of its own, else ``"mpidp"``; the same on every rank).
        store: ``"mpi"`` (``mpidp.store.MPIStore``: rank 0 holds the keys,
            they travel over MPI, no port; the default), ``"tcp"`` (torch's
            TCPStore on rank 0, bound to the rendezvous address) or ``"local"``
            (a process-local HashStore: "mpidp" only); ``MPIDP_STORE`` sets
            the default, which is "tcp" below MPI_THREAD_MULTIPLE. A torch
            ``Store`` is passed on to torch as it is.
        **kwargs: passed on (``timeout``, ``device_id``, ``pg_options``, ...);
            ``rank`` and ``world_size`` may be given and must equal MPI's. Without
            ``timeout``, a gloo or NCCL group waits the stall watchdog's timeout
            (``MPIDP_TIMEOUT``; see ``with_group_timeout``).
    """
    backend = default_backend() if backend is None else backend
    kwargs = with_group_timeout(backend, kwargs)
    _agree_on_init(backend, store, kwargs)
    if store is not None and not isinstance(store, str):
        dist.init_process_group(backend, store=store, **kwargs)
        return
    kwargs.setdefault("init_method", f"{SCHEME}://?store={_store_kind(store)}")
    dist.init_process_group(backend, **kwargs)  # "mpidp" was registered by import mpidp
