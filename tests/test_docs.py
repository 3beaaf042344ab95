"""The README and docs/ against the repository: links, MPIDP_* variables, the CI command, the API.

Everything is read from the tree at run time, so a module that moves or a variable that appears
is seen without editing this file.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
ENV_PAGE = ROOT / "docs" / "environment.md"
LIBRARY_TABLE = "Read by mpidp"
TOOLS_TABLE = "Read by the tests and the job scripts only"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
VARIABLE = re.compile(r"MPIDP_[A-Z0-9_]+")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where link syntax is literal."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(ch for ch in text.lower() if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for _, heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    prose = _prose(path.read_text())
    return LINK.findall(prose) + REFERENCE.findall(prose)


def broken_links(path: Path) -> list[str]:
    """The relative links of one page that point nowhere, each with the reason."""
    problems = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading with the anchor #{anchor} in "
                            f"{resolved.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_leaves_the_repository(page):
    """Paths written as text (``../shared/...``) must stay inside the repository too."""
    outside = [found for found in re.findall(r"(?<![\w.])\.\./[\w./-]*", page.read_text())
               if not (page.parent / found).resolve().is_relative_to(ROOT)]
    assert outside == []


def test_slugs_follow_github():
    assert slug("srun's `--mpi=` must match the MPI") == "sruns---mpi-must-match-the-mpi"
    assert slug("`MPIDP_DEBUG`: every rank must make the same call") == \
        "mpidp_debug-every-rank-must-make-the-same-call"
    assert slug("The torch.distributed backend") == "the-torchdistributed-backend"
    assert slug("Uneven inputs: `join()`") == "uneven-inputs-join"


def _python_names(folders: list[str], *, keywords: bool) -> set[str]:
    """MPIDP_* names that Python code uses as a whole string (an environment key), never comments
    or docstrings; with ``keywords``, also ``dict(os.environ, MPIDP_X="1")``-style keys."""
    names = set()
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if VARIABLE.fullmatch(node.value):
                        names.add(node.value)
                elif keywords and isinstance(node, ast.keyword) and node.arg:
                    if VARIABLE.fullmatch(node.arg):
                        names.add(node.arg)
    return names


def library_variables() -> set[str]:
    """The variables mpidp reads: whole-string MPIDP_* names in mpidp/ and kernels/, but the
    tests' and scripts' that ``mpidp.settings.OTHERS`` names for the doctor.

    ``MPIDP_INSTANTIATE`` and ``MPIDP_UNROLL`` are C macros of kernels/pack.cu (inside f-strings or
    .cu files), never whole strings, so they are not counted.
    """
    from mpidp import settings
    return _python_names(["mpidp", "kernels"], keywords=False) - set(settings.OTHERS)


def tool_variables() -> set[str]:
    """The variables only the tests, benchmarks, examples and scripts read."""
    names = _python_names(["tests", "bench", "examples"], keywords=True)
    for pattern in ("jobscripts/*.sh", "bench/*.sh", ".ci/*"):
        for path in ROOT.glob(pattern):
            names |= set(re.findall(r"\$\{?(MPIDP_[A-Z0-9_]+)", path.read_text()))
    return names - library_variables()


def documented(section: str) -> set[str]:
    """The variables in the first column of the table under the ``## section`` heading."""
    text = ENV_PAGE.read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/environment.md has no section '## {section}'"
    return set(re.findall(r"^\|\s*`(MPIDP_[A-Z0-9_]+)`\s*\|", match.group(1), re.M))


def test_the_scan_finds_what_the_code_reads():
    """A scan that found nothing would let every table pass."""
    assert {"MPIDP_TIMEOUT", "MPIDP_DEBUG", "MPIDP_CUDA_AWARE"} <= library_variables()
    assert "MPIDP_DRY_RUN" in tool_variables()


def test_environment_table_lists_every_variable_mpidp_reads():
    code, table = library_variables(), documented(LIBRARY_TABLE)
    assert not code - table, f"read by mpidp but missing from docs/environment.md: {sorted(code - table)}"
    assert not table - code, f"in docs/environment.md but never read by mpidp: {sorted(table - code)}"


def test_every_variable_is_declared_once_and_read_only_by_the_settings_module():
    """mpidp.settings declares every MPIDP_* variable; no other module reads the environment
    for one (an os.environ lookup, or a call other than settings.get/given, naming it)."""
    from mpidp import settings
    assert library_variables() == set(settings.SETTINGS), \
        f"named in mpidp/ but not declared: {sorted(library_variables() - set(settings.SETTINGS))}"
    stray = []
    for path in sorted((ROOT / "mpidp").rglob("*.py")):
        if path.name == "settings.py" and path.parent.name == "mpidp":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Call, ast.Subscript, ast.Compare)):
                continue
            names = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
                     and isinstance(n.value, str) and VARIABLE.fullmatch(n.value)]
            if not names:
                continue
            reader = ast.unparse(node.func) if isinstance(node, ast.Call) else ast.unparse(node)
            if isinstance(node, ast.Call) and reader in ("settings.get", "settings.given"):
                continue
            if "environ" in ast.unparse(node) or reader.split(".")[-1].lstrip("_") in (
                    "flag", "number", "choice", "text", "getenv"):
                stray.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not stray, "MPIDP_* read outside mpidp.settings:\n" + "\n".join(stray)
    with pytest.raises(ValueError, match="read MPIDP_\\* variables with mpidp.settings.get"):
        settings.flag("MPIDP_DEBUG", False)


def test_environment_table_defaults_follow_the_declarations():
    """Each row's default column starts with the declared default, spelled as the table does."""
    from mpidp import settings
    text = ENV_PAGE.read_text()
    spelled = {True: "on", False: "off", None: "unset"}
    for name, setting in settings.SETTINGS.items():
        row = re.search(rf"^\|\s*`{name}`\s*\|[^|]*\|\s*([^|]*)\|", text, re.M)
        assert row, name
        default = setting.default
        want = spelled[default] if default is None or isinstance(default, bool) else (
            f"`{default}`" if isinstance(default, str) else f"{default:g}")
        assert row.group(1).strip().startswith(want), (name, row.group(1), want)


def test_environment_table_lists_the_variables_of_tests_and_scripts():
    code, table = tool_variables(), documented(TOOLS_TABLE)
    assert code == table, f"missing: {sorted(code - table)}; never read: {sorted(table - code)}"
    from mpidp import settings  # the doctor knows them: not reported as unknown names
    assert set(settings.OTHERS) == table, f"mpidp.settings.OTHERS: {sorted(settings.OTHERS)}"


def _readme_test_command() -> str:
    match = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```", README.read_text(), re.S)
    assert match, "README.md has no <!-- test-command --> block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command_and_nothing_else():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if "pytest" in line and not line.lstrip().startswith("#")]
    assert ci_lines == [_readme_test_command()]


def test_readme_set_up_section_has_the_two_commands():
    text = README.read_text()
    section = re.search(r"^## [^\n]*\n(?:(?!^## ).)*<!-- test-command -->(?:(?!^## ).)*", text,
                        re.M | re.S)
    assert section, "the test command is not inside a ## section"
    blocks = re.findall(r"^```bash\n(.+?)\n```", section.group(0), re.M | re.S)
    assert len(blocks) == 2 and "examples/train.py" in blocks[0] and "pytest" in blocks[1]


def test_readme_stays_short():
    assert len(README.read_bytes()) <= 10 * 1024


HAND_KEPT = re.compile(
    r"\b\d[\d,]*\s+(?:tests?|passed|skipped|failed)\b"    # "286 tests", "269 passed"
    r"|\bpassed in\b"                                     # pytest's closing line
    r"|\b\d+\s+minutes?\s+\d+\s+seconds?\b"               # "13 minutes 45 seconds"
    r"|(?<!\d{4}-\d\d-\d\d )(?<![=:])\b\d{1,2}:\d\d\b(?!:)",  # "13:45" (a report's date and time,
                                                          # a setting's value "=3:13:...", a kill
                                                          # "--kill 2:60:allgather", are fine)
    re.I)


def test_no_hand_written_test_counts_or_suite_times():
    files = [*PAGES, *sorted(ROOT.glob("bench/*.md")), *sorted(ROOT.glob("examples/*.py"))]
    found = [f"{path.relative_to(ROOT)}: {match.group(0)!r}" for path in files
             for match in HAND_KEPT.finditer(path.read_text())]
    assert found == []


def test_every_test_command_block_is_the_ci_command():
    """docs/testing.md shows the command too: each <!-- test-command --> block must be CI's."""
    blocks = {str(page.relative_to(ROOT)): re.findall(r"<!-- test-command -->\n```bash\n(.+?)\n```",
                                                    page.read_text(), re.S) for page in PAGES}
    assert blocks["docs/testing.md"], "docs/testing.md shows no <!-- test-command --> block"
    wrong = {page: found for page, found in blocks.items()
             if any(block.strip() != _readme_test_command() for block in found)}
    assert wrong == {}


# -- the index: user guides, internals, measurements ------------------------------------------

INDEX = ROOT / "docs" / "README.md"
DATE = re.compile(r"(?<![\w/-])20\d\d-\d\d-\d\d(?![\w/-])")
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])")


def index_sections() -> dict[str, set[str]]:
    """The pages each ``## section`` of docs/README.md links to."""
    sections = {}
    for match in re.finditer(r"^## (.+?)\n(.*?)(?=^## |\Z)", INDEX.read_text(), re.M | re.S):
        sections[match.group(1).strip()] = set(re.findall(r"\]\(([\w-]+\.md)\)", match.group(2)))
    return sections


def test_the_index_lists_every_page_once_by_kind():
    sections = index_sections()
    assert set(sections) == {"User guides", "Internals", "Measurements"}
    listed = [page for pages in sections.values() for page in pages]
    pages = {path.name for path in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert sorted(listed) == sorted(pages), "each page of docs/ in exactly one section of docs/README.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dates_and_commits_only_on_measurement_pages(page):
    """Dated figures age; they belong on the measurement pages (a report's path may hold a date)."""
    if page.parent.name == "docs" and page.name in index_sections()["Measurements"]:
        return
    text = page.read_text()
    assert DATE.findall(text) == [] and COMMIT.findall(text) == []


PAGE_LIMIT = 16 * 1024  # bytes: a page read in one sitting; a longer one is split by subject
BEING_SPLIT: set[str] = set()  # over the limit while others still edit them; a split empties it


def test_every_docs_page_is_at_most_16_kb():
    """A guide that grew past the limit is split by subject, its links fixed, not trimmed."""
    sizes = {path.name: len(path.read_bytes()) for path in (ROOT / "docs").glob("*.md")}
    assert BEING_SPLIT <= set(sizes), f"no such page: {sorted(BEING_SPLIT - set(sizes))}"
    over = {name: size for name, size in sizes.items()
            if size > PAGE_LIMIT and name not in BEING_SPLIT}
    assert over == {}, f"docs pages over {PAGE_LIMIT} bytes: {over}"


def test_the_measurement_index_lists_every_measurement_page():
    """performance.md is the index of the measurements: it links every page that the
    Measurements section of docs/README.md lists, and every performance-*.md page is listed there."""
    measurements = index_sections()["Measurements"]
    index = (ROOT / "docs" / "performance.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", index))
    unlinked = measurements - linked - {"performance.md"}
    assert unlinked == set(), f"measurement pages docs/performance.md does not link: {sorted(unlinked)}"
    unlisted = {path.name for path in (ROOT / "docs").glob("performance*.md")} - measurements
    assert unlisted == set(), f"not under Measurements in docs/README.md: {sorted(unlisted)}"


# -- the API reference -------------------------------------------------------------------------

def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_docstring():
    assert _gen_api().undocumented() == []


def test_the_api_reference_is_current():
    """docs/api.md and its pages are what docs/gen_api.py writes now: run it after changing a
    public name."""
    pages = _gen_api().render()
    written = {path.name for path in (ROOT / "docs").glob("api*.md")}
    assert written == set(pages), \
        f"docs/ has {sorted(written)}, the generator writes {sorted(pages)}: run python docs/gen_api.py"
    stale = sorted(name for name, text in pages.items() if (ROOT / "docs" / name).read_text() != text)
    assert stale == [], f"stale: {stale}: run python docs/gen_api.py"


def test_the_api_reference_covers_every_public_name():
    import mpidp
    import mpidp.horovod
    text = "".join(path.read_text() for path in sorted((ROOT / "docs").glob("api*.md")))
    modules = [mpidp, mpidp.horovod, *(getattr(mpidp, name) for name in mpidp.__all__
                                       if inspect.ismodule(getattr(mpidp, name)))]
    names = {f"{module.__name__}.{name}" for module in modules for name in module.__all__
             if not inspect.ismodule(getattr(module, name))}
    missing = sorted(name for name in names if f"### `{name}`" not in text)
    assert missing == []


# -- Python in the docs against the real modules ------------------------------------------------

PYTHON_BLOCK = re.compile(r"^(?:<!-- runs: (\d) -->\n)?(?:<!-- given: ([^>]*) -->\n)?"
                          r"```python\n(.*?)^```", re.M | re.S)


def python_blocks() -> list[tuple[str, str, int | None]]:
    """(page, code, ranks it runs on or None) for every ```python block of the pages."""
    return [(str(page.relative_to(ROOT)), match.group(3),
             int(match.group(1)) if match.group(1) else None)
            for page in PAGES for match in PYTHON_BLOCK.finditer(page.read_text())]


def _undefined(code: str) -> set[str]:
    """Names a block reads that it never imports, assigns, defines or takes as an argument."""
    defined, used = set(dir(builtins)), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return used - defined


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_that_import_define_what_they_use(page):
    """A block with an import reads as a program: every name it uses is imported or defined there,
    or named before it in ``<!-- given: a, b -->`` (what the reader brings). A block without an
    import is a fragment of the text around it."""
    problems = []
    for match in PYTHON_BLOCK.finditer(page.read_text()):
        code = match.group(3)
        if not any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(ast.parse(code))):
            continue
        given = {name.strip() for name in (match.group(2) or "").split(",") if name.strip()}
        missing = _undefined(code) - given
        if missing:
            problems.append(f"{code.splitlines()[0]!r}...: uses {sorted(missing)}")
    assert problems == []


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Names that stand for an mpidp module in a block: mpidp itself, ``import mpidp.x as y``,
    ``from mpidp import x``."""
    names = {"mpidp": "mpidp"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mpidp.") and alias.asname:
                    names[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpidp":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _resolve(path: str):
    """The object ``mpidp.a.b.c`` names: the longest importable module, then getattr."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)  # AttributeError: the docs name something that is not there
        return obj
    raise ImportError(path)


def mpidp_references(code: str) -> tuple[list[str], list[tuple[str, ast.Call]]]:
    """The mpidp names a block uses, and its calls of mpidp callables."""
    tree = ast.parse(code)
    aliases = _aliases(tree)
    names, calls = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                names.add(".".join([aliases[parts[0]], *parts[1:]]))
        if isinstance(node, ast.Call):
            parts = _dotted(node.func)
            if parts and parts[0] in aliases:
                calls.append((".".join([aliases[parts[0]], *parts[1:]]), node))
    return sorted(names), calls


BLOCKS = python_blocks()


@pytest.mark.parametrize("page,code", [(page, code) for page, code, _ in BLOCKS],
                         ids=[f"{page}:{index}" for index, (page, _, _) in enumerate(BLOCKS)])
def test_python_blocks_name_what_mpidp_has(page, code):
    """Every ``mpidp.x.y`` a block uses exists, and every call's arguments fit its signature."""
    names, calls = mpidp_references(code)
    unknown = []
    for name in names:
        try:
            _resolve(name)
        except (AttributeError, ImportError) as err:
            unknown.append(f"{name}: {err}")
    assert unknown == []
    wrong = []
    for name, call in calls:
        target = _resolve(name)
        if any(isinstance(arg, ast.Starred) for arg in call.args) or \
                any(keyword.arg is None for keyword in call.keywords):
            continue  # *args or **kwargs: nothing to check statically
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind_partial(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as err:
            wrong.append(f"{name}({ast.unparse(call)[len(ast.unparse(call.func)) + 1:]}: {err}")
    assert wrong == []


INLINE_SIGNATURE = re.compile(r"`(mpidp(?:\.\w+)+)\(([^`]*)\)`")


def inline_signatures() -> list[tuple[str, str, str]]:
    """(page, name, written parameters) for inline code such as ``mpidp.x.f(a, *, b=None)``."""
    return [(str(page.relative_to(ROOT)), match.group(1), match.group(2))
            for page in PAGES for match in INLINE_SIGNATURE.finditer(FENCE.sub("", page.read_text()))]


@pytest.mark.parametrize("page,name,written", inline_signatures(),
                         ids=[f"{p}:{n}" for p, n, _ in inline_signatures()])
def test_inline_signatures_match_the_code(page, name, written):
    """Prose that writes out a call or a signature of an mpidp function gets its kinds right:
    a keyword-only parameter written as positional (or a name that does not exist) fails."""
    target = _resolve(name)
    real = inspect.signature(target).parameters
    try:  # a signature: parameter names, kinds, defaults
        written_params = ast.parse(f"def _({written}): pass").body[0].args
    except SyntaxError:
        written_params = None
    if written_params is not None:
        positional = written_params.posonlyargs + written_params.args
        named = {a.arg for a in positional[len(positional) - len(written_params.defaults):]}
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in real.values())
        problems = []
        for arg, kind in [(a.arg, "positional") for a in positional] + \
                         [(a.arg, "keyword-only") for a in written_params.kwonlyargs]:
            if arg not in real:  # a bare positional name may be an argument value, as in f(model)
                if (kind == "keyword-only" or arg in named) and not takes_any:
                    problems.append(f"{arg}: no such parameter")
                continue
            is_kwonly = real[arg].kind is inspect.Parameter.KEYWORD_ONLY
            if is_kwonly != (kind == "keyword-only"):
                problems.append(f"{arg}: written {kind}, is "
                                f"{'keyword-only' if is_kwonly else 'positional'}")
        assert problems == [], f"{page}: {name}({written}) against {inspect.signature(target)}"
        return
    try:  # a call: its keywords must exist
        call = ast.parse(f"f({written})", mode="eval").body
    except SyntaxError:  # prose with "..." or the like: the names at least
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in real.values())
    unknown = [k.arg for k in call.keywords if k.arg and k.arg not in real and not takes_any]
    assert unknown == [], f"{page}: {name} has no parameter {unknown}"


# -- complete snippets run ------------------------------------------------------------------

RUNNABLE = [(page, code, ranks) for page, code, ranks in BLOCKS if ranks]


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def test_some_snippets_are_marked_to_run():
    assert len({page for page, _, _ in RUNNABLE}) >= 3


def _missing_extra(code: str) -> str | None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]):
                if importlib.util.find_spec(name.split(".")[0]) is None:
                    return f"{name} is not installed (an extra)"
    return None


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory) -> dict[int, tuple[subprocess.CompletedProcess, list[str]]]:
    """Every runnable snippet of a rank count in one launch (tests/mpi/run_scripts.py), each
    as the whole program in a file of its own, in the order of RUNNABLE: {ranks: (result,
    the files in order)}. A snippet that fails ends the launch; the ones after it never run."""
    folder = tmp_path_factory.mktemp("snippets")
    sizes: dict[int, list[str]] = {}
    for index, (_, code, ranks) in enumerate(RUNNABLE):
        if _missing_extra(code) is None:
            (folder / f"snippet_{index}.py").write_text(code)
            sizes.setdefault(ranks, []).append(f"snippet_{index}.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    runner = str(ROOT / "tests" / "mpi" / "run_scripts.py")
    return {ranks: (subprocess.run([_mpiexec(), "-n", str(ranks), sys.executable, runner, *files],
                                   cwd=folder, env=env, capture_output=True, text=True, timeout=400,
                                   start_new_session=True), files)
            for ranks, files in sizes.items()}


@pytest.mark.parametrize("index", range(len(RUNNABLE)),
                         ids=[f"{page}:{index}" for index, (page, _, _) in enumerate(RUNNABLE)])
def test_complete_snippets_run(index, snippet_runs):
    """A block marked ``<!-- runs: N -->`` is a whole program: pasted into a file, it runs at N ranks."""
    page, code, ranks = RUNNABLE[index]
    if why := _missing_extra(code):
        pytest.skip(why)
    result, files = snippet_runs[ranks]
    mine = files.index(f"snippet_{index}.py")
    started = [f for f in files if f"=== run_scripts: {f}\n" in result.stdout]
    ended = len(started) > mine + 1 or result.returncode == 0
    assert started[-1:] != [files[mine]] or ended, \
        f"{page}:\n{code}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert files[mine] in started, f"not reached: the snippet before it failed ({started[-1]})"


# -- samples of what the code writes -------------------------------------------------------------

def test_the_info_sample_shows_every_line_info_prints():
    """docs/cluster.md's sample of ``python -m mpidp info`` has a line for each label it prints."""
    source = (ROOT / "mpidp" / "__main__.py").read_text()
    labels = set(re.findall(r'print\(f?"([A-Za-z][\w -]*):\s', source)) - {"warning"}  # on problems only
    assert {"MPI library", "torch backend"} <= labels, "the scan of mpidp/__main__.py found no labels"
    text = (ROOT / "docs" / "cluster.md").read_text()
    sample = re.search(r"^## The info report\n.*?^```\n(.*?)^```", text, re.M | re.S)
    assert sample, "docs/cluster.md has no sample under ## The info report"
    shown = {line.split(":")[0] for line in sample.group(1).splitlines() if ":" in line}
    assert labels - shown == set()


def test_zero_checkpoint_file_names_are_the_ones_save_sharded_writes():
    """The names the docs give for save_sharded's files follow the format in mpidp/zero/checkpoint.py."""
    source = (ROOT / "mpidp" / "zero" / "checkpoint.py").read_text()
    fmt = re.search(r'f"(zero-rank\{\w+\.rank(:\w*)?\}-of-\{\w+\.world(:\w*)?\}\.pt)"', source)
    assert fmt, "save_sharded's file name format was not found"
    rank_spec, world_spec = (fmt.group(2) or ":")[1:], (fmt.group(3) or ":")[1:]
    wrong = []
    for page in PAGES:
        for rank, world in re.findall(r"zero-rank(\d+)-of-(\d+)\.pt", page.read_text()):
            expected = f"zero-rank{int(rank):{rank_spec}}-of-{int(world):{world_spec}}.pt"
            if f"zero-rank{rank}-of-{world}.pt" != expected:
                wrong.append(f"{page.relative_to(ROOT)}: zero-rank{rank}-of-{world}.pt, not {expected}")
        for rank, world in re.findall(r"zero-rank\{([^}]*)\}-of-\{([^}]*)\}\.pt", page.read_text()):
            if not (rank.endswith(f":{rank_spec}") and world.endswith(f":{world_spec}")):
                wrong.append(f"{page.relative_to(ROOT)}: zero-rank{{{rank}}}-of-{{{world}}}.pt "
                             f"leaves out the format ({rank_spec!r}, {world_spec!r})")
    assert wrong == []
