"""One home per rule, kept: scans of mpidp's source that fail when a rule grows a second home.

Each scan reads the code (``ast``), so a new module is covered without a line here; each
has a check that it finds what it looks for in a file made for it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mpidp import settings

PACKAGE = Path(__file__).resolve().parent.parent / "mpidp"


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
             if settings.SETTINGS[name].read != "import"}
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
