"""One home per rule, kept: scans of mpidp's source that fail when a rule grows a second home.

Each scan reads the code (``ast``), so a new module is covered without a line here; each
has a check that it finds what it looks for in a file made for it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpidp"


def _settings_module():
    """mpidp/settings.py alone (it imports nothing of mpidp): no MPI start-up for a scan."""
    spec = importlib.util.spec_from_file_location("_mpidp_settings", PACKAGE / "settings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@functools.cache
def _sources() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE.parent)): ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


# -- an MPIDP_* setting declared "use" is read at each use, never once at import --------------

def _setting_read(call: ast.Call) -> str | None:
    """The ``MPIDP_*`` name a ``settings.get("MPIDP_...")`` call reads (None: another call)."""
    func = call.func
    if (isinstance(func, ast.Attribute) and func.attr == "get"
            and isinstance(func.value, ast.Name) and func.value.id in ("settings", "_settings")
            and call.args and isinstance(call.args[0], ast.Constant)
            and str(call.args[0].value).startswith("MPIDP_")):
        return call.args[0].value
    return None


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _import_time_nodes(tree: ast.Module):
    """The nodes Python runs when it imports the module: all but function bodies."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(node.decorator_list if not isinstance(node, ast.Lambda) else [])
            continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


def read_at_import(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Each ``MPIDP_*`` setting read while a module is imported, with the module that reads it:
    by ``settings.get`` in the module's own statements, or through a call there of a function
    (of any module, by name) whose body reads it directly."""
    readers: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = {_setting_read(call) for call in ast.walk(node) if isinstance(call, ast.Call)}
                readers.setdefault(node.name, set()).update(names - {None})
    found = {}
    for module, tree in trees.items():
        for node in _import_time_nodes(tree):
            if isinstance(node, ast.Call):
                direct = _setting_read(node)
                for name in ({direct} if direct else readers.get(_called_name(node), set())):
                    found.setdefault(name, module)
    return found


def test_a_setting_read_at_import_is_declared_so():
    wrong = {name: module for name, module in read_at_import(_sources()).items()
             if _settings_module().SETTINGS[name].read != "import"}
    assert not wrong, (f"read once at import but declared read at each use in mpidp/settings.py "
                       f"(read='use'): {wrong}; declare read='import', or read it where it is used")


def test_the_import_time_scan_sees_direct_and_indirect_reads():
    p = "MPIDP" + "_"  # names of no setting, spelled so that tests/test_docs.py's scan skips them
    trees = {"a.py": ast.parse(f'from . import settings\n'
                               f'X = settings.get("{p}A")\n'
                               f'def later():\n    return settings.get("{p}B")\n'
                               f'def reader():\n    return settings.get("{p}C")\n'),
             "b.py": ast.parse(f'from . import a as _a\nY = _a.reader()\n'
                               f'class K:\n    Z = [settings.get("{p}D")]\n')}
    assert read_at_import(trees) == {p + "A": "a.py", p + "C": "b.py", p + "D": "b.py"}


# -- a tensor is divided by a rank count only through mpidp.comm.chunking ----------------------

# Divisors that count ranks (or, in reproducible mode, micro-batches over the ranks).
RANK_COUNTS = {"size", "world", "world_size", "divisor", "_divisor", "_scale", "count", "nranks"}
# The home of the rule, and the listed exception that divides itself (chunking's docstring).
DIVIDES_ITSELF = {"mpidp/comm/chunking.py": "the helpers",
                  "mpidp/horovod/reductions.py": "Horovod's Average and postscale_factor"}


def _divisor(call: ast.Call):
    """The divisor of a tensor division (``t.div_(d)``, ``t.div(d)``, ``torch.div(t, d)``)."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in ("div", "div_", "true_divide",
                                                                "true_divide_"):
        return None
    is_torch = isinstance(func.value, ast.Name) and func.value.id == "torch"
    args = call.args[1:] if is_torch else call.args
    return args[0] if args else None


def _counts_ranks(node) -> bool:
    if isinstance(node, ast.Call):  # comm.Get_size(), process_set.size()
        return getattr(node.func, "attr", None) in ("Get_size", "size")
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    return name in RANK_COUNTS


# Divisions by ``/`` whose divisor reads as a rank count but that divide no gradient: a
# number, a count of samples, or a listed exception (chunking's docstring), by expression.
NOT_BY_RANKS = {
    "mpidp/checkpoint.py: position['global_batch'] / self.world": "a number, for a message",
    "mpidp/ddp/stragglers.py: periods / self.world": "milliseconds, a number",
    "mpidp/ddp/syncbn.py: sums / count": "the samples' count, not the ranks'",
    "mpidp/ddp/syncbn.py: total / ctx.count": "the samples' count, not the ranks'",
    "mpidp/ddp/syncbn.py: m2 / count": "the samples' count, not the ranks'",
    "mpidp/horovod/collectives.py: gathered / size": "Horovod's sparse Average (listed)",
}


def _slash_divisor(node):
    """The divisor of ``a / d`` or ``a /= d``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return node.right
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
        return node.value
    return None


def divisions_by_ranks(trees: dict[str, ast.Module]) -> list[str]:
    """Each ``file:line`` that divides a tensor by a rank count outside ``DIVIDES_ITSELF``
    (by ``/`` too, but for ``NOT_BY_RANKS``)."""
    found = []
    for module, tree in trees.items():
        if module in DIVIDES_ITSELF:
            continue
        for node in ast.walk(tree):
            divisor = _divisor(node) if isinstance(node, ast.Call) else _slash_divisor(node)
            if divisor is not None and _counts_ranks(divisor) \
                    and f"{module}: {ast.unparse(node)}" not in NOT_BY_RANKS:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_tensors_are_divided_by_rank_counts_through_chunking_alone():
    found = divisions_by_ranks(_sources())
    assert not found, ("divided by a rank count outside mpidp.comm.chunking's helpers (divide, "
                       "divided, mean_of_sum): " + "; ".join(found) + ". Use them, or list the "
                       "exception with its reason in chunking's docstring (a number that is no "
                       "gradient: in NOT_BY_RANKS)")


def test_the_division_scan_sees_each_form():
    tree = ast.parse("def f(t, out, comm, size, norm):\n"
                     "    t.div_(size)\n"
                     "    torch.div(t, self._scale, out=out)\n"
                     "    t.div(comm.Get_size())\n"
                     "    t.div_(norm)\n"            # not a rank count
                     "    torch.div(size, 2)\n"      # divides the count itself
                     "    u = t / world_size\n"
                     "    t /= self._divisor\n")
    assert sorted(int(line.split(":")[1]) for line in divisions_by_ranks({"x.py": tree})) == \
        [2, 3, 4, 7, 8]


# -- a size in MiB becomes bytes in mpidp.comm.chunking alone (its Sizes and MB) ---------------

def _is_mib(node) -> bool:
    """``1 << 20``, ``2 ** 20``, ``1024 * 1024``, ``1048576`` or a name ``_MB``/``MB`` of its own."""
    if isinstance(node, ast.Constant):
        return node.value == 1 << 20
    if isinstance(node, ast.Name):
        return node.id in ("_MB", "MB")
    if isinstance(node, ast.BinOp) and isinstance(node.left, ast.Constant) \
            and isinstance(node.right, ast.Constant):
        left, right = node.left.value, node.right.value
        return ((isinstance(node.op, ast.LShift) and (left, right) == (1, 20))
                or (isinstance(node.op, ast.Pow) and (left, right) == (2, 20))
                or (isinstance(node.op, ast.Mult) and (left, right) == (1024, 1024)))
    return False


def mib_to_bytes(trees: dict[str, ast.Module]) -> list[str]:
    """Each ``file:line`` outside chunking that multiplies by a MiB of its own or defines one
    (dividing by one, to print a size, is no size rule)."""
    found = []
    for module, tree in trees.items():
        if module == "mpidp/comm/chunking.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) \
                    and (_is_mib(node.left) or _is_mib(node.right)) and not _is_mib(node):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Assign) and _is_mib(node.value):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_sizes_in_mib_become_bytes_in_chunking_alone():
    found = mib_to_bytes(_sources())
    assert not found, ("a MiB of its own: " + "; ".join(found) + ". Build the sizes with "
                       "mpidp.comm.chunking.Sizes.of (or multiply by chunking.MB)")


def test_the_mib_scan_sees_each_spelling():
    tree = ast.parse("_MB = 1024 * 1024\n"
                     "a = int(cap_mb * (1 << 20))\n"
                     "b = mb * 2**20\n"
                     "c = f'{size / 2**20:.1f} MiB'\n"      # printing a size
                     "d = cap_mb * chunking.MB\n")          # chunking's own
    assert sorted(int(line.split(":")[1]) for line in mib_to_bytes({"x.py": tree})) == [1, 2, 3]


# -- a gather of every rank's facts is judged in mpidp.comm.agreement -------------------------

# The gathers of pickled objects outside the agreement that judge nothing: data a rank uses,
# or a report. A gather whose list every rank then judges goes through agreement.decide,
# judged, decide_alike or decide_rows, so the judge reads the gathered facts alone.
GATHERS_DATA = {
    "mpidp/__main__.py:info": "python -m mpidp info: rank 0 prints each rank's threads",
    "mpidp/checkpoint.py:step": "rank 0 prints which ranks were signalled (the stop was agreed)",
    "mpidp/cuda.py:placements": "the GPU facts, cached: backend_choice.backend_for reads them "
                                "on every rank alike",
    "mpidp/doctor/__init__.py:run": "the doctor's context: rank 0's launcher",
    "mpidp/doctor/checks.py:_gather": "the doctor's facts: each check's pure judge_* reads them "
                                      "on every rank alike (the module's docstring)",
    "mpidp/healing/fsdp.py:take": "the FSDP2 shards' pieces, which make the whole state",
    "mpidp/healing/zero.py:take": "the ZeRO shards' pieces, which every survivor regroups",
    "mpidp/rendezvous.py:_node_rank": "the nodes' first ranks: this rank's node's index",
    "mpidp/rendezvous.py:_choose": "the nodes' addresses to rank 0, which chooses and broadcasts",
    "mpidp/topology.py:gather": "every rank's layout, for tables and rank 0's warnings",
    "mpidp/topology.py:node_affinities": "the node's bindings: this rank's share of the threads",
    "mpidp/zero/checkpoint.py:consolidate_state_dict": "the optimizer's state, to one rank",
}
_OBJECT_GATHERS = ("allgather", "gather")


def _gathers_objects(call: ast.Call) -> bool:
    """``watched_allgather(...)``, ``collective(comm, "allgather"|"gather", ...)`` or
    ``watched(label, comm.allgather, ...)``: mpi4py's pickled gathers."""
    name = _called_name(call)
    if name == "watched_allgather":
        return True
    if name == "collective":
        return len(call.args) > 1 and isinstance(call.args[1], ast.Constant) \
            and call.args[1].value in _OBJECT_GATHERS
    return name == "watched" and any(isinstance(arg, ast.Attribute) and arg.attr in _OBJECT_GATHERS
                                     for arg in call.args)


def _calls_by_function(tree: ast.Module):
    """(the innermost function's name, a call in it), for every call inside a function."""
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            pending = list(function.body)
            while pending:
                node = pending.pop()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue  # its own turn
                if isinstance(node, ast.Call):
                    yield function.name, node
                pending.extend(ast.iter_child_nodes(node))


def object_gathers(trees: dict[str, ast.Module]) -> dict[str, int]:
    """Each ``module:function`` outside the agreement that gathers pickled objects, with a line."""
    found = {}
    for module, tree in trees.items():
        if module != "mpidp/comm/agreement.py":
            for function, call in _calls_by_function(tree):
                if _gathers_objects(call):
                    found.setdefault(f"{module}:{function}", call.lineno)
    return found


def test_facts_gathered_to_be_judged_go_through_the_agreement():
    found = {site: line for site, line in object_gathers(_sources()).items()
             if site not in GATHERS_DATA}
    assert not found, (f"a gather of every rank's facts outside mpidp.comm.agreement: {found}. "
                       f"Judge them through agreement.decide/judged (or list a gather that "
                       f"judges nothing in GATHERS_DATA, with its reason)")


def test_the_gather_scan_sees_each_form():
    tree = ast.parse("def a(comm):\n    return agreement.watched_allgather(comm, 1, 'x')\n"
                     "def b(comm):\n    return collective(comm, 'gather', (1, 0), 'x')\n"
                     "def c(comm):\n    def inner():\n"
                     "        return _watchdog.watched('x', comm.allgather, 1)\n"
                     "    return inner()\n"
                     "def d(comm):\n    return collective(comm, 'bcast', (1, 0), 'x')\n"
                     "def e(comm, t):\n    return _comm.allgather(t, t, comm=comm)\n")  # tensors
    assert object_gathers({"x.py": tree}) == {"x.py:a": 2, "x.py:b": 4, "x.py:inner": 7}
