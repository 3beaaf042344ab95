"""The import graph of mpidp: no circle, no import from a lower layer up; each module one purpose.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a
deferred import is still a dependency, and the circles it hid were the ones to
remove. A new module needs a line in ``LAYERS``.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpidp"

# Each layer may import its own and the layers below it, never one above.
LAYERS = [
    ("base", ["settings", "errors", "_args", "communicators", "address", "generators",
              "comm.dtypes", "zero.elementwise", "horovod.timeline", "horovod.compression",
              "store.server", "recorder"]),
    # trace reads the files stacks writes; cuda agrees on the ranks' GPUs over the engine
    ("runtime", ["runtime", "exits", "topology", "stacks", "trace", "watchdog", "watchdog.*", "sampler"]),
    ("communication", ["comm", "comm.*", "cuda", "objects", "optimizer", "store", "rendezvous",
                       "backend_choice", "preemption", "spares"]),
    ("ddp", ["ddp", "ddp.*", "hooks", "hooks.*"]),
    ("backend", ["process_group", "process_group.*"]),
    ("zero and horovod", ["zero", "zero.*", "horovod", "horovod.*", "checkpoint", "checkpoint_format",
                          "healing", "healing.*"]),
    ("package", ["", "__main__", "doctor", "doctor.*", "profiler", "frtrace"]),
]
MOST_LINES = 500  # soft: over it, a warning, not a failure


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _layer(name: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if name == member or (member.endswith(".*") and name.startswith(member[:-1])):
                return index
    raise AssertionError(f"mpidp.{name} is in no layer of tests/test_layers.py")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mpidp modules ``name`` imports (relative to ``mpidp``), anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            elif node.module and (node.module == "mpidp" or node.module.startswith("mpidp.")):
                base = node.module.removeprefix("mpidp").removeprefix(".")
            else:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mpidp."):
                    found.add(alias.name.removeprefix("mpidp."))
    return {module for module in found if module in modules and module != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer_and_imports_none_above_it():
    upward = [f"mpidp.{name} ({LAYERS[_layer(name)][0]}) imports mpidp.{other} "
              f"({LAYERS[_layer(other)][0]})"
              for name, imported in sorted(_graph().items()) for other in sorted(imported)
              if _layer(other) > _layer(name)]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (circle := visit(other)):
                return circle
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state:
            circle = visit(name)
            assert circle is None, " -> ".join(f"mpidp.{n}" for n in circle)


def test_the_scan_sees_deferred_and_type_checking_imports(tmp_path):
    fake = tmp_path / "runtime.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .process_group.work import Work\n"
                    "def f():\n    from . import watchdog\n    import mpidp.comm.handle\n")
    assert _imports("runtime", fake, _modules()) == {"process_group.work", "watchdog", "comm.handle"}


def _purpose(path: Path) -> str:
    """A module's purpose: the first paragraph of its docstring, joined into one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _one_sentence(purpose: str) -> bool:
    text = purpose.replace("e.g.", "eg").replace("i.e.", "ie")
    return bool(text) and text.endswith((".", ":", "?")) and not any(
        stop in text[:-1] for stop in (". ", "? ", "! "))


def test_every_module_states_one_purpose_in_one_sentence():
    """A module is cut by its concept: its docstring opens with the one thing it holds.

    Size is not the rule (a concept may need more lines than a reader likes; such a module gets a
    warning below), but a module whose opening paragraph needs two sentences, or none, holds two
    things or nothing nameable, and is cut again.
    """
    wrong = {f"mpidp.{name}": _purpose(path) or "no docstring"
             for name, path in sorted(_modules().items()) if not _one_sentence(_purpose(path))}
    assert not wrong, "\n".join(f"{n}: {p!r}" for n, p in wrong.items())


def test_the_purpose_check_catches_two_sentences_and_none(tmp_path):
    two = tmp_path / "two.py"
    two.write_text('"""Holds the pools. Also parses settings."""\n')
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    one = tmp_path / "one.py"
    one.write_text('"""Round-robin pools of communicators, e.g. for DDP.\n\nMore here. And here."""\n')
    assert not _one_sentence(_purpose(two)) and not _one_sentence(_purpose(none))
    assert _one_sentence(_purpose(one))


def test_modules_over_the_soft_size_warn():
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {f"mpidp.{n}": c for n, c in sorted(long.items()) if c > MOST_LINES}
    if over:
        warnings.warn(f"modules over {MOST_LINES} lines (a soft limit; cut by concept, not by "
                      f"trimming): {over}", stacklevel=1)


# MPI's completion calls, as mpi4py spells them (the lowercase -all/-any/-some forms are
# mpi4py's for pickled requests; a lowercase wait/test is too common a name to tell apart).
_COMPLETIONS = {f"{verb}{form}" for verb in ("Wait", "Test") for form in ("", "all", "any", "some")}
_COMPLETIONS |= {name.lower() for name in _COMPLETIONS if name not in ("Wait", "Test")}
# The engine completes every operation in flight (mpidp.comm.progress); the watchdog's and
# the store's channels serve that layer, so they complete their own messages.
_COMPLETING = ("comm", "comm.*", "watchdog.report", "store", "store.*")


def _completion_calls(path: Path) -> list[str]:
    """``line: call`` for each MPI completion call in ``path``: ``x.Test(...)``, ``getattr(x, "Wait")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
        if name in _COMPLETIONS:
            found.append((node.lineno, name))
    return [f"{line}: {name}" for line, name in sorted(found)]


def _completes(name: str) -> bool:
    return any(name == member or (member.endswith(".*") and name.startswith(member[:-1]))
               for member in _COMPLETING)


def test_only_the_engine_completes_mpi_requests():
    """One engine completes operations: no MPI Wait/Test (-all/-any/-some) outside mpidp.comm,
    but the watchdog's and the store's own channels (a private wait loop is a second engine)."""
    stray = {f"mpidp.{name}": calls for name, path in sorted(_modules().items())
             if not _completes(name) and (calls := _completion_calls(path))}
    assert not stray, ("MPI completion calls outside the engine; start an Operation "
                       "(mpidp.comm.operation) and complete it through mpidp.comm.progress: "
                       + "; ".join(f"{n} line {', line '.join(c)}" for n, c in stray.items()))


def test_the_completion_scan_sees_every_form(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("def f(r, rs, c):\n    while not r.Test():\n        pass\n"
                    "    MPI.Request.Waitall(rs)\n    c.isend(1, 0).wait()\n    getattr(r, 'Wait')()\n"
                    "    MPI.Request.testsome(rs)\n")
    assert _completion_calls(fake) == ["2: Test", "4: Waitall", "6: Wait", "7: testsome"]
    assert _completes("comm.progress") and _completes("store.server")
    assert not _completes("process_group.progress") and not _completes("watchdog")


def _own_bases(name: str, path: Path, modules: dict[str, Path]) -> dict[str, list[str]]:
    """Each class of module ``name`` -> its bases that are classes of mpidp (as written).

    A base is mpidp's when it is a class of the same module, a name imported from an mpidp
    module, or an attribute of an mpidp module imported under an alias (``_overlap.Base``).
    """
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    imported, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "mpidp"):
            for alias in node.names:
                bound = alias.asname or alias.name
                parts = package.split(".") if package and node.level else []
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                is_module = f"{base}.{alias.name}".removeprefix("mpidp.").strip(".") in modules
                (aliases if is_module else imported).add(bound)
        elif isinstance(node, ast.Import):
            aliases.update(alias.asname or alias.name for alias in node.names
                           if alias.name.split(".")[0] == "mpidp")
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            own = [ast.unparse(base) for base in node.bases
                   if (isinstance(base, ast.Name) and base.id in local | imported)
                   or (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                       and base.value.id in aliases)]
            found[node.name] = own
    return found


def test_no_class_is_built_from_two_of_mpidps_own_classes():
    """Collaborators, not mixins: an object holds its parts, each owning its state; a class
    mixed from two of mpidp's classes spreads one object's state over several files."""
    modules = _modules()
    mixed = [f"mpidp.{name}.{cls}({', '.join(bases)})"
             for name, path in sorted(modules.items())
             for cls, bases in _own_bases(name, path, modules).items() if len(bases) >= 2]
    assert not mixed, "classes mixed from mpidp's own classes: " + "; ".join(mixed)


def test_the_base_scan_tells_mpidps_classes_from_others(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("import torch\nfrom torch import nn\nfrom . import overlap as _overlap\n"
                    "from .buckets import Bucket\nclass Local:\n    pass\n"
                    "class Mixed(Local, Bucket, nn.Module):\n    pass\n"
                    "class Aliased(_overlap.InlineStrategy, Local):\n    pass\n"
                    "class One(Bucket, torch.optim.Optimizer, nn.Module):\n    pass\n")
    bases = _own_bases("ddp.fake", fake, _modules())
    assert bases == {"Local": [], "Mixed": ["Local", "Bucket"],
                     "Aliased": ["_overlap.InlineStrategy", "Local"], "One": ["Bucket"]}
