"""The README and docs/ against the repository: links, MPIDP_* variables, the CI command.

Everything is read from the tree at run time, so a module that moves or a variable that appears
is seen without editing this file.
"""

from __future__ import annotations

import ast
import re
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
    """The variables mpidp reads: whole-string MPIDP_* names in mpidp/ and kernels/.

    ``MPIDP_INSTANTIATE`` and ``MPIDP_UNROLL`` are C macros of kernels/pack.cu (inside f-strings or
    .cu files), never whole strings, so they are not counted.
    """
    return _python_names(["mpidp", "kernels"], keywords=False)


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
    r"|(?<!\d{4}-\d\d-\d\d )\b\d{1,2}:\d\d\b",            # "13:45" (a report's date and time is fine)
    re.I)


def test_no_hand_written_test_counts_or_suite_times():
    files = [*PAGES, *sorted(ROOT.glob("bench/*.md")), *sorted(ROOT.glob("examples/*.py"))]
    found = [f"{path.relative_to(ROOT)}: {match.group(0)!r}" for path in files
             for match in HAND_KEPT.finditer(path.read_text())]
    assert found == []
