"""No request in the test suite runs on a client library's default timeout.

A default is a machine-speed assumption: httpx gives up after 5 s, Playwright after 30 s per action, and
the openai SDK retries a failed request twice, which turns a server error into a pass. So the sources the
suite runs (tests/**/*.py, examples/**/*.py and the Python examples of README.md and docs/**/*.md) are
read with `ast`, and each of these calls must say its timeout:

* httpx's module-level requests (`httpx.get`, `post`, `put`, `patch`, `delete`, `head`, `options`,
  `request`, `stream`) and its clients (`httpx.Client`, `httpx.AsyncClient`): a `timeout=` keyword
  (`None` or a generous number; a short one on purpose, as in a test that expects a time-out, is the
  author's call). A request made through a client inherits the client's timeout, so it is not checked.
* `requests.*` and `urllib.request.urlopen`: a `timeout=` keyword.
* `OpenAI(...)` and `AsyncOpenAI(...)` in tests/: `timeout=` and `max_retries=` (the SDK's 10 minutes
  are generous, but its two retries would hide a 500). The docs' examples and examples/ show the client
  as a reader writes it; their runners set `OPENAI_LOG=info` and fail a run whose log shows a retry
  (tests/doc_examples.py, tests/e2e/test_streaming_e2e.py).
* Playwright: a `launch(...)` gets `timeout=`, and a function that opens a context or page
  (`new_context`, `new_page`) also calls `set_default_timeout`.
* A call that passes `**kwargs` and no `timeout=` is reported: the scanner cannot read the dict.

Exempt, because no timeout can fire there: in-process ASGI apps. Starlette's `TestClient` and an httpx
client whose `transport=` is an `httpx.ASGITransport(...)` (or a name assigned one in the same module)
call the app directly, with no socket and no timer; httpx enforces its timeouts only in its network
transport, so a `timeout=` there would promise what it cannot do. tests/api runs the app that way.
"""

from __future__ import annotations

import ast

import pytest

from doc_examples import ROOT, collect, rel

HTTPX_REQUESTS = {"get", "post", "put", "patch", "delete", "head", "options", "request", "stream"}
HTTPX_CLIENTS = {"Client", "AsyncClient"}
REQUESTS_REQUESTS = {"get", "post", "put", "patch", "delete", "head", "options", "request"}
IN_PROCESS_TRANSPORTS = {"ASGITransport", "WSGITransport"}
OPENAI_CLIENTS = {"OpenAI", "AsyncOpenAI"}


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it stands for: `from m import x as y` binds y to m.x, `import a.b` binds a to a,
    `import a.b as y` binds y to a.b."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
    return names


def _keywords(call: ast.Call) -> set[str | None]:
    return {k.arg for k in call.keywords}  # None stands for **kwargs


def _is_in_process_transport(node: ast.AST, imports: dict[str, str], assigned: dict[str, ast.AST]) -> bool:
    if isinstance(node, ast.Name) and node.id in assigned:
        node = assigned[node.id]
    if not isinstance(node, ast.Call):
        return False
    origin = _origin(node.func, imports)
    return origin is not None and origin.split(".")[-1] in IN_PROCESS_TRANSPORTS and origin.startswith("httpx.")


def _origin(func: ast.AST, imports: dict[str, str]) -> str | None:
    """The dotted name a call's function refers to, its first part resolved through the imports."""
    dotted = _dotted(func)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    head = imports.get(head, head)
    return f"{head}.{rest}" if rest else head


def find_default_timeouts(source: str, where: str, sdk_rule: bool = True) -> list[str]:
    """Every call in `source` that runs on a default timeout, as ``"where:line: what"``."""
    tree = ast.parse(source)
    imports = _imported_names(tree)
    assigned = {t.id: node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    uses_playwright = any(origin.startswith("playwright") for origin in imports.values())
    problems = []

    def report(call: ast.Call, what: str, needs: list[str]) -> None:
        if None in _keywords(call):
            what += " (its **kwargs cannot be read)"
        problems.append((call.lineno, f"{what} without {' and '.join(n + '=' for n in needs)}"))

    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        origin = _origin(call.func, imports)
        if origin is None:
            continue
        module, _, name = origin.rpartition(".")
        have = _keywords(call)
        if module == "httpx" and name in HTTPX_REQUESTS | HTTPX_CLIENTS and "timeout" not in have:
            transport = next((k.value for k in call.keywords if k.arg == "transport"), None)
            if name in HTTPX_CLIENTS and transport is not None and _is_in_process_transport(transport, imports, assigned):
                continue
            report(call, f"{origin}(...)", ["timeout"])
        elif module == "requests" and name in REQUESTS_REQUESTS and "timeout" not in have:
            report(call, f"{origin}(...)", ["timeout"])
        elif origin == "urllib.request.urlopen" and "timeout" not in have:
            report(call, f"{origin}(...)", ["timeout"])
        elif sdk_rule and name in OPENAI_CLIENTS and module in ("openai", ""):
            needs = [n for n in ("timeout", "max_retries") if n not in have]
            if needs:
                report(call, f"{origin}(...)", needs)
        elif name == "launch" and uses_playwright and "timeout" not in have:
            report(call, f"{_dotted(call.func)}(...)", ["timeout"])

    # Playwright: whoever opens a context or a page sets its default timeout.
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for func in functions if uses_playwright else []:
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        opens = [c for c in calls if c.func.attr in ("new_context", "new_page")]
        if opens and not any(c.func.attr == "set_default_timeout" for c in calls):
            problems.append((opens[0].lineno, f"{func.name} opens a Playwright {opens[0].func.attr} "
                                              "without set_default_timeout"))
    return [f"{where}:{line}: {what}" for line, what in sorted(problems)]


def suite_sources() -> list[tuple[str, str, bool]]:
    """(where, source, whether the SDK rule applies) for every Python source the suite runs."""
    out = []
    for folder, sdk_rule in (("tests", True), ("examples", False)):
        for path in sorted((ROOT / folder).rglob("*.py")):
            out.append((rel(path), path.read_text(encoding="utf-8"), sdk_rule))
    examples, _ = collect()
    for ex in examples:
        if ex.lang == "python":
            out.append((f"{ex.where} (example {ex.name})", ex.code, False))
    return out


def test_the_suite_names_every_timeout():
    sources = suite_sources()
    assert any(where.startswith("tests/e2e/") for where, _, _ in sources)
    assert any("(example " in where for where, _, _ in sources)
    problems = [p for where, source, sdk_rule in sources for p in find_default_timeouts(source, where, sdk_rule)]
    assert not problems, "calls on a default timeout:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# The scanner itself, on small sources


FLAGGED = """\
import httpx
import httpx as h
from httpx import post as send, AsyncClient
from openai import OpenAI
import openai
import requests
import urllib.request
from playwright.sync_api import sync_playwright

httpx.get(url)
h.post(url, json={})
send(url)
with httpx.stream("POST", url) as r:
    pass
AsyncClient(base_url=url)
httpx.Client(transport=httpx.HTTPTransport(retries=1))
httpx.post(url, **options)
OpenAI(base_url=url, api_key="x")
openai.AsyncOpenAI(base_url=url, timeout=60)
requests.get(url)
urllib.request.urlopen(url)

def browse(p):
    browser = p.chromium.launch(executable_path="x")
    page = browser.new_page()
"""

ACCEPTED = """\
import httpx
from fastapi.testclient import TestClient
from openai import OpenAI
from playwright.sync_api import sync_playwright

httpx.get(url, timeout=None)
httpx.post(url, json={}, timeout=600)
with httpx.stream("POST", url, timeout=httpx.Timeout(600)) as r:
    pass
transport = httpx.ASGITransport(app=app)
httpx.AsyncClient(transport=transport, base_url="http://test")
httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
with httpx.Client(timeout=60) as c:
    c.get("/health")
TestClient(app).get("/health")
OpenAI(base_url=url, api_key="x", timeout=600, max_retries=0)

def browse(p):
    browser = p.chromium.launch(executable_path="x", timeout=600_000)
    ctx = browser.new_context()
    ctx.set_default_timeout(600_000)
    page = ctx.new_page()
"""


def test_scanner_flags_each_default():
    problems = find_default_timeouts(FLAGGED, "t.py")
    lines = sorted(int(p.split(":")[1]) for p in problems)
    assert lines == [10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 24, 25], problems
    text = "\n".join(problems)
    assert "t.py:18: openai.OpenAI(...) without timeout= and max_retries=" in text
    assert "t.py:19: openai.AsyncOpenAI(...) without max_retries=" in text
    assert "t.py:17: httpx.post(...) (its **kwargs cannot be read) without timeout=" in text
    assert "t.py:25: browse opens a Playwright new_page without set_default_timeout" in text


def test_scanner_accepts_explicit_timeouts_and_in_process_apps():
    assert find_default_timeouts(ACCEPTED, "t.py") == []


def test_sdk_rule_off_for_readers_examples():
    assert find_default_timeouts("from openai import OpenAI\nOpenAI(api_key='x')\n", "ex", sdk_rule=False) == []


@pytest.mark.parametrize("where", ["tests/e2e/test_playground.py", "tests/e2e/conftest.py"])
def test_files_that_used_defaults_are_scanned(where):
    assert (ROOT / where).is_file()
    assert any(w == where for w, _, _ in suite_sources())
