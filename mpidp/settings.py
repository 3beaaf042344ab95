"""Every ``MPIDP_*`` environment variable, declared once and read here.

Each variable is a ``Setting``: its name, its kind, its default, when mpidp
reads it and one line saying what it does. Its kind names its one parser here;
``get(name)`` is the one way mpidp reads a value, and ``problems()`` (the
doctor's) checks every ``MPIDP_*`` variable set with the same parsers.
docs/environment.md's table is checked against ``SETTINGS`` by
tests/test_docs.py. The readers for other programs' variables (``HOROVOD_*``,
``MASTER_ADDR``) follow the same spelling rules and refuse ``MPIDP_`` names.

Imports nothing from mpidp and never touches MPI, so any module may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal

__all__ = ["Setting", "SETTINGS", "OTHERS", "get", "given", "flag", "number", "choice", "text",
           "problems", "values", "tolerate_bad_values"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``MPIDP_*`` variable.

    Attributes:
        name: the variable.
        kind: "flag", "number", "integer", "choice", "text", "signals" or "kills" (its parser).
        default: the value when it is unset or blank.
        read: when mpidp reads it ("import": once, at ``import mpidp``; "use": at each use).
        doc: what it does, one line.
        minimum: the smallest value a number or integer may take.
        choices: the values a choice may take (lowercase).
    """

    name: str
    kind: str
    default: object
    read: str
    doc: str
    minimum: float = 0
    choices: tuple[str, ...] = ()


_DECLARED = (
    Setting("MPIDP_ABORT_ON_EXCEPTION", "flag", True, "import",
            "an uncaught exception or a non-zero sys.exit on one rank aborts the whole job"),
    Setting("MPIDP_CHUNK_MB", "number", 4.0, "import",
            "largest single allreduce in MiB; larger ones go in chunks of this size",
            minimum=0.001),
    Setting("MPIDP_CHECK_CALLS", "flag", True, "import",
            "the backend checks that every rank's call has the same shape"),
    Setting("MPIDP_CUDA_AWARE", "flag", None, "import",
            "hand device memory to MPI (1) or stage through host memory (0); unset: detect"),
    Setting("MPIDP_DEBUG", "flag", False, "import",
            "before every collective, check that every rank makes the same call"),
    Setting("MPIDP_EXPORT_ENV", "flag", True, "import",
            "start the rendezvous store at import and export the torchrun variables"),
    Setting("MPIDP_POOL_SIZE", "integer", 2, "use",
            "duplicated communicators in a pool", minimum=1),
    Setting("MPIDP_PROGRESS_SPIN_MS", "number", 10.0, "import",
            "ms the progress thread tests without sleeping after a request arrives or completes"),
    Setting("MPIDP_RDZV_ADDR", "text", None, "use",
            "the address of rank 0's host for the rendezvous store"),
    Setting("MPIDP_RDZV_IFACE", "text", None, "use",
            "the interface of rank 0's host whose address serves the rendezvous store"),
    Setting("MPIDP_RDZV_TIMEOUT", "number", 60.0, "use",
            "seconds a rank tries to reach the rendezvous store", minimum=0.001),
    Setting("MPIDP_SET_THREADS", "flag", True, "import",
            "set torch's intra-op threads to this rank's share of its cores"),
    Setting("MPIDP_SHARED_MEMORY", "flag", None, "use",
            "the default of DistributedDataParallel(shared_memory=None)"),
    Setting("MPIDP_SHM_NODE_SIZE", "integer", 0, "use",
            "testing: pretend that blocks of this many consecutive ranks are nodes"),
    Setting("MPIDP_STAGE_CPU", "flag", False, "import",
            "testing: send CPU tensors through the host-staging path"),
    Setting("MPIDP_STORE", "choice", None, "use",
            "the store handed to torch; unset: mpi (tcp below MPI_THREAD_MULTIPLE)",
            choices=("mpi", "tcp", "local")),
    Setting("MPIDP_STRAGGLER_MS", "number", 100.0, "use",
            "a rank this many ms later than the earliest at the end of most steps is named a straggler (0: off)"),
    Setting("MPIDP_STRAGGLER_SHARE", "number", 0.1, "use",
            "a rank is late at a step only when also this share of the step's time late (0: MPIDP_STRAGGLER_MS alone)"),
    Setting("MPIDP_STRAGGLER_STEPS", "integer", 5, "use",
            "the synced steps a rank's lateness is judged over", minimum=1),
    Setting("MPIDP_TRACE_DIR", "text", None, "use",
            "where each rank writes its flight record and stacks; unset: ./mpidp-trace-<job id>"),
    Setting("MPIDP_TRACE_ENTRIES", "integer", 2048, "import",
            "collectives each rank's flight recorder keeps, the latest (0: off)"),
    Setting("MPIDP_TRACE_SIGNALS", "signals", None, "import",
            "signals that write every thread's stack and the flight record; unset: SIGTERM; none: off"),
    Setting("MPIDP_TEST_KILL", "kills", None, "import",
            "testing: RANK:N[:TEXT],...: launch rank RANK starts its N-th collective (labelled TEXT) and ends itself"),
    Setting("MPIDP_TIMEOUT", "number", 600.0, "import",
            "seconds an mpidp call may wait before the stall watchdog reports it (0: off)"),
    Setting("MPIDP_TIMEOUT_ACTION", "choice", "abort", "import",
            "what a stall does: abort or report", choices=("abort", "report")),
)

SETTINGS: dict[str, Setting] = {setting.name: setting for setting in _DECLARED}

# Read by the tests and the job scripts, never by mpidp (docs/environment.md's second table):
# the doctor knows them, so they are not reported as unknown.
OTHERS = ("MPIDP_DRY_RUN", "MPIDP_TEST_GPU", "MPIDP_TEST_IMPI", "MPIDP_TEST_OPENMPI",
          "MPIDP_TEST_PATH", "MPIDP_TEST_PRRTE")

_tolerant = False  # tolerate_bad_values() was called


def tolerate_bad_values() -> None:
    """From now on ``get`` returns a bad value's default instead of raising.

    For ``python -m mpidp doctor`` alone: Python imports mpidp, whose start-up
    reads settings, before the doctor runs, and the doctor must live to report
    the bad value (``problems()``) rather than die of it.
    """
    global _tolerant
    _tolerant = True


def get(name: str):
    """The value of the declared variable ``name``, read from the environment now.

    Raises:
        KeyError: ``name`` is not declared in ``SETTINGS``.
        ValueError: naming the variable, the rule and the value (never after
            ``tolerate_bad_values()``: the default then).
    """
    try:
        return _parse(SETTINGS[name])
    except ValueError:
        if not _tolerant:
            raise
        return SETTINGS[name].default


def _parse(setting: Setting):
    name = setting.name
    if setting.kind == "flag":
        return _flag(name, setting.default)
    if setting.kind in ("number", "integer"):
        return _number(name, setting.default, minimum=setting.minimum,
                       integer=setting.kind == "integer")
    if setting.kind == "choice":
        return _choice(name, setting.choices, setting.default)
    if setting.kind == "signals":
        return _signals(name, setting.default)
    if setting.kind == "kills":
        return _kills(name, setting.default)
    return _text(name)


def problems() -> list[str]:
    """What is wrong with the ``MPIDP_*`` variables set now, one line each (``python -m mpidp doctor``).

    A declared variable whose value breaks its rule (its parser's error, the
    one ``get`` raises), and every undeclared name, which mpidp would ignore
    (with the declared name it is a near miss of, if any). The names of
    ``OTHERS`` pass.
    """
    found = []
    for name in sorted(n for n in os.environ if n.startswith("MPIDP_")):
        if name in SETTINGS:
            try:
                _parse(SETTINGS[name])
            except ValueError as error:
                found.append(str(error))
        elif name not in OTHERS:
            close = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.85)
            found.append(f"{name} is no mpidp setting: " +
                         (f"did you mean {close[0]}?" if close else "mpidp ignores it"))
    return found


def values() -> dict[str, str]:
    """The declared variables that are set, as written (to compare across ranks)."""
    return {name: os.environ[name] for name in SETTINGS if given(name)}


def given(name: str) -> bool:
    """True if the variable is set to something other than blanks (what the readers take for unset)."""
    return bool(os.environ.get(name, "").strip())


def _foreign(name: str) -> str:
    if name.startswith("MPIDP_"):
        raise ValueError(f"{name}: read MPIDP_* variables with mpidp.settings.get, "
                         f"after declaring them in mpidp.settings.SETTINGS")
    return name


def flag(name: str, default: bool | None) -> bool | None:
    """Another program's boolean variable (see ``_flag``)."""
    return _flag(_foreign(name), default)


def number(name: str, default: float, *, minimum: float = 0, integer: bool = False) -> float:
    """Another program's numeric variable (see ``_number``)."""
    return _number(_foreign(name), default, minimum=minimum, integer=integer)


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Another program's variable that takes one of ``choices`` (see ``_choice``)."""
    return _choice(_foreign(name), choices, default)


def text(name: str) -> str | None:
    """Another program's free-form variable (see ``_text``)."""
    return _text(_foreign(name))


def _flag(name: str, default):
    """1/true/yes/on or 0/false/no/off, any case; unset or empty is ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)} "
                     f"(any case), got {value!r}")


def _number(name: str, default, *, minimum: float = 0, integer: bool = False):
    """A number >= ``minimum`` (an int if ``integer``); unset or empty is ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    kind = "an integer" if integer else "a number"
    try:
        parsed = int(value) if integer else float(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed != parsed or parsed < minimum:
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")
    return parsed


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` (lowercase), any case; unset or empty is ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (any case), got {value!r}")
    return value.lower()


def _signals(name: str, default):
    """Names of signals that can be caught, comma-separated ("SIGTERM,USR1", any case), as
    signal numbers; ``none`` is no signal; unset or empty is ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() == "none":
        return ()
    numbers = []
    for part in (part.strip().upper() for part in value.split(",") if part.strip()):
        full = part if part.startswith("SIG") else "SIG" + part
        found = getattr(signal.Signals, full, None) if full.isidentifier() else None
        if found is None or found in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name} must name signals that can be caught "
                             f"(\"SIGTERM,SIGUSR1\") or be none, got {value!r}")
        numbers.append(int(found))
    return tuple(dict.fromkeys(numbers))


def _kills(name: str, default):
    """Test kill points ``RANK:N[:TEXT]``, comma-separated, N >= 1, as ``{(RANK, TEXT): N}``;
    unset or empty is ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    points = {}
    for item in value.split(","):
        rank, _, rest = item.partition(":")
        count, _, text = rest.partition(":")
        if not (rank.strip().isdigit() and count.strip().isdigit() and int(count) > 0):
            raise ValueError(f"{name} must be RANK:N[:TEXT][,RANK:N[:TEXT]...] with N >= 1, "
                             f"got {value!r}")
        points[int(rank), text] = int(count)
    return points


def _text(name: str) -> str | None:
    """A free-form value (an address, an interface name), stripped; unset or blank is None."""
    value = os.environ.get(name, "").strip()
    return value or None
