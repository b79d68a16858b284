"""The documentation's links and example markers: every relative link in README.md and docs/**/*.md
points at a file of the checkout (and at a heading that exists, for a `.md#fragment`), and the example
parser (tests/doc_examples.py) reads the convention the docs follow.

Slow: the example runner's own tests start Python processes."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from doc_examples import (ROOT, Example, check_output, collect, doc_files, outside_fences, parse_examples,
                          run_example)

SKIPPED_SCHEMES = {"http", "https", "mailto"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_HTML_ANCHOR = re.compile(r"""<[A-Za-z][^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""")
_HTML_LINK = re.compile(r"""<(?:a|img|source)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
_REF_DEF = re.compile(r"^ {0,3}\[(?!\^)[^\]]+\]:[ \t]*(<[^>]*>|\S+)")


# ---------------------------------------------------------------------------------------------------
# Markdown reading


def _blank(s: str) -> str:
    """`s` with everything but newlines turned to spaces (offsets and line numbers stay put)."""
    return re.sub(r"[^\n]", " ", s)


def mask_comments(text: str) -> str:
    return re.sub(r"<!--.*?-->", lambda m: _blank(m.group(0)), text, flags=re.DOTALL)


def mask_code_spans(text: str) -> str:
    """Inline code spans blanked: a run of n backticks up to the next run of exactly n."""
    out, i = [], 0
    for m in re.finditer(r"`+", text):
        if m.start() < i:
            continue
        n = len(m.group(0))
        close = re.compile(r"(?<!`)`{%d}(?!`)" % n).search(text, m.end())
        if close is None:
            continue
        out.append(text[i:m.start()])
        out.append(_blank(text[m.start():close.end()]))
        i = close.end()
    out.append(text[i:])
    return "".join(out)


def prose(text: str) -> str:
    """The text outside fenced blocks and HTML comments, line numbers kept."""
    return mask_comments("\n".join(outside_fences(text)) + "\n")


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _has_opening_bracket(text: str, close: int) -> bool:
    """Whether the `]` at `close` closes a `[` in the same paragraph."""
    depth = 0
    for k in range(close - 1, -1, -1):
        c = text[k]
        if c == "\n" and text[k - 1:k] == "\n":
            return False
        if c == "]" and text[k - 1:k] != "\\":
            depth += 1
        elif c == "[" and text[k - 1:k] != "\\":
            if depth == 0:
                return True
            depth -= 1
    return False


def _destination(text: str, start: int) -> str | None:
    """The link destination starting at `start` (just after the `(`)."""
    k = start
    while k < len(text) and text[k] in " \t\n":
        k += 1
    if text[k:k + 1] == "<":
        end = text.find(">", k)
        return None if end < 0 else text[k + 1:end]
    depth, j = 0, k
    while j < len(text):
        c = text[j]
        if c == "\\" and j + 1 < len(text):
            j += 2
            continue
        if c.isspace():
            break
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                break
            depth -= 1
        j += 1
    return re.sub(r"\\(.)", r"\1", text[k:j])


def links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` for every inline link and image, reference definition and HTML href/src
    outside fenced blocks, inline code and HTML comments."""
    masked = mask_code_spans(prose(text))
    found = []
    for m in re.finditer(r"\]\(", masked):
        if _has_opening_bracket(masked, m.start()):
            target = _destination(masked, m.end())
            if target is not None:
                found.append((_line_of(masked, m.end()), target))
    for n, line in enumerate(masked.splitlines(), 1):
        if (d := _REF_DEF.match(line)):
            found.append((n, d.group(1).strip("<>")))
        found += [(n, h) for h in _HTML_LINK.findall(line)]
    return sorted(found)


def _heading_text(raw: str) -> str:
    """A heading's rendered text, near enough for its slug: links and images to their text, HTML
    tags and emphasis delimiters dropped, code spans' content kept as is."""
    parts = re.split(r"(`+[^`]*?`+)", raw)
    out = []
    for k, part in enumerate(parts):
        if k % 2:
            out.append(part.strip("`"))
            continue
        part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)
        part = re.sub(r"<[^>]+>", "", part)
        part = re.sub(r"(?<!\w)_+|_+(?!\w)", "", part)
        out.append(part)
    return "".join(out).strip()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but hyphens and underscores dropped,
    each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", _heading_text(heading).lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The fragments a link to this file may use: heading slugs (repeats numbered -1, -2, ... as
    GitHub does) and HTML id/name attributes."""
    lines = prose(text).splitlines()
    seen: dict[str, int] = {}
    result: set[str] = set()

    def add(heading: str) -> None:
        s = slug(heading)
        if s in seen:
            seen[s] += 1
            result.add(f"{s}-{seen[s]}")
        else:
            seen[s] = 0
            result.add(s)

    for k, line in enumerate(lines):
        if (m := _ATX.match(line)):
            add(m.group(2) or "")
        elif (k and _SETEXT.match(line) and lines[k - 1].strip()
              and not _ATX.match(lines[k - 1]) and not re.match(r"^\s*([-*+>|]|\d+[.)])", lines[k - 1])):
            add(lines[k - 1].strip())
        result.update(_HTML_ANCHOR.findall(line))
    return result


# ---------------------------------------------------------------------------------------------------
# Checking


def _inside(path: str, root: Path) -> bool:
    return os.path.commonpath([path, str(root)]) == str(root)


def git_ignored(paths: list[Path], root: Path) -> set[Path]:
    """Those of `paths` that git ignores in `root` (a reader's checkout does not have them); empty
    when `root` is not a git work tree or git is missing."""
    if not paths:
        return set()
    try:
        proc = subprocess.run(["git", "-C", str(root), "check-ignore", "--stdin", "-z"],
                              input="\0".join(str(p) for p in paths) + "\0",
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if proc.returncode not in (0, 1):
        return set()
    return {Path(p) for p in proc.stdout.split("\0") if p}


def check_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """Every bad relative link in `files` as ``"file:line: target: reason"``."""
    root = Path(os.path.realpath(root))
    problems: list[tuple[str, str]] = []  # (where, message)
    existing: list[tuple[str, str, Path]] = []  # links to check against .gitignore
    anchor_cache: dict[Path, set[str]] = {}
    for md in files:
        md = Path(os.path.abspath(md))
        where_file = os.path.relpath(md, root)
        for line, target in links(md.read_text(encoding="utf-8")):
            where = f"{where_file}:{line}"
            t = target.strip()
            bad = lambda why: problems.append((where, f"{target!r}: {why}"))  # noqa: E731
            if not t:
                bad("empty link")
                continue
            if t.startswith("#") or t.startswith("//"):
                continue
            if (s := _SCHEME.match(t)):
                if s.group(1).lower() not in SKIPPED_SCHEMES:
                    bad(f"a {s.group(1)}: link (only http, https and mailto links are left unchecked)")
                continue
            path_part, _, fragment = t.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            if path_part.startswith("/"):
                bad("an absolute path; write it relative to the markdown file")
                continue
            lexical = os.path.normpath(os.path.join(md.parent, path_part))
            real = os.path.realpath(lexical)
            if not _inside(lexical, root) or not _inside(real, root):
                bad(f"resolves to {real}, outside the repository ({root}); a reader's checkout has no such file")
                continue
            if not os.path.exists(real):
                bad(f"no such file ({os.path.relpath(lexical, root)})")
                continue
            existing.append((where, target, Path(real)))
            if fragment and real.endswith(".md") and os.path.isfile(real):
                p = Path(real)
                if p not in anchor_cache:
                    anchor_cache[p] = anchors(p.read_text(encoding="utf-8"))
                frag = unquote(fragment)
                if frag not in anchor_cache[p]:
                    near = [a for a in sorted(anchor_cache[p]) if a.startswith(frag)][:3] or \
                        difflib.get_close_matches(frag, sorted(anchor_cache[p]), n=3)
                    bad(f"no heading with anchor #{frag} in {os.path.relpath(real, root)}"
                        + (f" (did you mean {', '.join('#' + n for n in near)}?)" if near else ""))
    ignored = git_ignored(sorted({p for _, _, p in existing}), root)
    for where, target, p in existing:
        if p in ignored:
            problems.append((where, f"{target!r}: git ignores {os.path.relpath(p, root)}; a reader's checkout "
                                    "does not have it"))

    def order(item):
        f, _, n = item[0].rpartition(":")
        return f, int(n), item[1]

    return [f"{w}: {msg}" for w, msg in sorted(problems, key=order)]


def test_doc_files_found():
    assert ROOT / "README.md" in doc_files()


def test_relative_links_resolve():
    problems = check_links(doc_files())
    assert not problems, f"{len(problems)} bad link(s) in the docs:\n" + "\n".join(problems)


def test_doc_examples_well_formed():
    _, errors = collect()
    assert not errors, "doc example markers:\n" + "\n".join(errors)


# ---------------------------------------------------------------------------------------------------
# The checkers themselves, on small in-memory documents


def test_link_checker(tmp_path):
    root = tmp_path / "repo"
    (root / "docs" / "img").mkdir(parents=True)
    (root / "docs" / "img" / "a b.png").write_bytes(b"")
    (root / "examples").mkdir()
    (root / "examples" / "x.py").write_text("")
    (root / "docs" / "guide.md").write_text(
        "# Guide\n\n## Install it: `pip` & co.\n\n## Install it: `pip` & co.\n\nSetext Title\n------------\n\n"
        '<a id="custom"></a>\n\n## The `__init__` hook\n\n## [Linked](guide.md) *heading*\n')
    (tmp_path / "outside.md").write_text("")
    readme = root / "README.md"
    readme.write_text(
        "[ok](docs/guide.md) ![img](docs/img/a%20b.png) [dir](examples/) [py](examples/x.py#L3)\n"
        "[web](https://example.com/x) [mail](mailto:a@b.c) [anchor](#nothing-checked)\n"
        "[frag](docs/guide.md#install-it-pip--co) [frag2](docs/guide.md#install-it-pip--co-1)\n"
        "[setext](docs/guide.md#setext-title) [html](docs/guide.md#custom)\n"
        "[code](docs/guide.md#the-__init__-hook) [linked](docs/guide.md#linked-heading)\n"
        "[`code` text](<docs/guide.md>) [[nested]](docs/guide.md) [![badge](docs/img/a%20b.png)](docs/guide.md)\n"
        "[missing](docs/absent.md)\n"
        "[out](../outside.md)\n"
        "[badfrag](docs/guide.md#install)\n"
        "[abs](/docs/guide.md)\n"
        "[file](file:///etc/passwd)\n"
        "`[in code](nope1.md)` and <!-- [in comment](nope2.md) -->\n"
        "```markdown\n[in fence](nope3.md)\n```\n"
        "[wrapped\ntext](docs/missing2.md)\n"
        '<img src="docs/img/none.png">\n'
        "[ref]: docs/missing3.md\n"
        "[^note]: a footnote, not a link\n")
    problems = check_links([readme, root / "docs" / "guide.md"], root)
    got = [(p.split(":")[0] + ":" + p.split(":")[1], p) for p in problems]
    lines = {w for w, _ in got}
    assert lines == {"README.md:7", "README.md:8", "README.md:9", "README.md:10", "README.md:11",
                     "README.md:17", "README.md:18", "README.md:19"}, problems
    text = "\n".join(problems)
    assert "outside the repository" in text and "did you mean #install-it-pip--co" in text
    assert "absolute path" in text and "a file: link" in text
    assert "nope" not in text


def test_link_checker_reports_git_ignored(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    if subprocess.run(["git", "init", "-q", str(root)], capture_output=True).returncode:
        pytest.skip("git unavailable")
    (root / ".gitignore").write_text("build/\n")
    (root / "build").mkdir()
    (root / "build" / "out.html").write_text("")
    (root / "README.md").write_text("[built](build/out.html)\n")
    assert check_links([root / "README.md"], root) == [
        "README.md:1: 'build/out.html': git ignores build/out.html; a reader's checkout does not have it"]


DOC = """\
# Examples

<!-- example: first -->

```python
print("logprob:", -1.2345)
```

Some prose.

```text
logprob: -1.2...
```

<!-- example: no-output -->
```bash
echo hi
```

```json
{"not": "its output"}
```

<!-- example: nested -->
````python
code = '''
```text
not a fence end
```
<!-- example: inside-a-fence -->
'''
print(len(code.splitlines()))
````
```text
5
```

<!-- example: prose-first -->
Oops, prose.

<!-- example: wrong-lang -->
```json
{}
```

<!-- example bad name -->
<!-- example: trailing -->
"""


def test_parser_reads_the_convention():
    examples, errors = parse_examples(DOC, ROOT / "docs" / "x.md")
    assert [(e.name, e.lang, e.line, e.marker_line) for e in examples] == [
        ("first", "python", 5, 3), ("no-output", "bash", 16, 15), ("nested", "python", 25, 24)]
    first, no_output, nested = examples
    assert first.code == 'print("logprob:", -1.2345)\n'
    assert first.expected == "logprob: -1.2...\n" and first.expected_line == 11
    assert no_output.expected is None
    assert "```text\nnot a fence end\n```\n<!-- example: inside-a-fence -->" in nested.code
    assert nested.expected == "5\n"
    assert errors == [
        "docs/x.md:38: example 'prose-first' is not followed by a ```python or ```bash block "
        "(text comes first, line 39)",
        "docs/x.md:41: example 'wrong-lang' is followed by a ```json block (line 42); it must be "
        "```python or ```bash",
        "docs/x.md:46: malformed example marker '<!-- example bad name -->'; write it alone on its line as "
        "<!-- example: NAME --> (NAME: letters, digits, hyphens)",
        "docs/x.md:47: example 'trailing' is not followed by a ```python or ```bash block (the file ends)",
    ]


def test_parser_flags_duplicates_and_unclosed_fences(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("<!-- example: same -->\n```bash\ntrue\n```\n")
    b.write_text("<!-- example: same -->\n```python\npass\n```\n\n```bash\nunclosed\n")
    examples, errors = collect([a, b])
    assert [e.name for e in examples] == ["same"]
    assert len(errors) == 2
    assert any("b.md:2: example name 'same' already used at" in e for e in errors), errors
    assert any("b.md:6: unclosed code fence" in e for e in errors), errors


def test_output_matching():
    assert check_output("logprob: -...\n", "logprob: -1.2345\n")
    assert check_output("a ...\nz", "a b c\n  d\nz\n")
    assert check_output("x   y\n", "x y")
    assert not check_output("logprob: -1.2...\n", "logprob: -1.4\n")
    assert not check_output("a\n", "b\n")


def test_numbers_match_within_one_unit_of_their_last_shown_digit():
    """Another CPU's kernels move float32 numbers in their last bits: a shown decimal number matches one
    within one unit of its last digit, cut (followed by ...) or rounded; all else is compared exactly."""
    want = '"token_logprobs": [\n    -2.9738...,\n    -1.1971...\n],\n'
    assert check_output(want, '"token_logprobs": [\n    -2.9739015102386475,\n    -1.197169542312622\n],')
    assert check_output(want, '"token_logprobs": [\n    -2.973701,\n    -1.1971\n],')
    assert not check_output(want, '"token_logprobs": [\n    -2.9740015,\n    -1.1971695\n],')
    assert not check_output(want, '"token_logprobs": [\n    -2.9738015,\n    -1.1969\n],')
    assert not check_output(want, '"token_logprob": [\n    -2.9738015,\n    -1.1971695\n],')
    assert not check_output(want, '"token_logprobs": [\n    2.9738015,\n    -1.1971695\n],')
    table = "  11,640.5       8  3 'Colorless'\n     435.6       7  0 'The cat'\n"
    assert check_output(table, "  11,640.6       8  3 'Colorless'\n     435.5       7  0 'The cat'\n")
    assert check_output(table, "  11,640.44      8  3 'Colorless'\n     435.6       7  0 'The cat'\n")
    assert not check_output(table, "  11,640.7       8  3 'Colorless'\n     435.6       7  0 'The cat'\n")
    assert not check_output(table, "  11,640.5       9  3 'Colorless'\n     435.6       7  0 'The cat'\n")
    assert not check_output(table, "     435.6       7  0 'The cat'\n  11,640.5       8  3 'Colorless'\n")
    assert check_output("mean 1.25e-05 at 127.0.0.1 ...", "mean 1.26e-05 at 127.0.0.1 and more")
    assert not check_output("mean 1.25e-05 at 127.0.0.1", "mean 1.25e-05 at 127.0.0.2")
    assert not check_output("mean 1.25e-05", "mean 1.27e-05")


def _ex(code, lang="python", expected=None):
    return Example(name="t", path=ROOT / "docs" / "t.md", line=3, marker_line=1, lang=lang, code=code,
                   expected=expected, expected_line=7 if expected is not None else None)


def test_runner_on_trivial_programs():
    env_code = ("import os, pathlib; print(os.environ['LOGPROBE_URL'], os.environ['MPLBACKEND']);"
                "pathlib.Path('plot.png').write_bytes(b''); print(sorted(os.listdir('.')))")
    assert run_example(_ex(env_code, expected="http://h:1 Agg\n['plot.png']\n"), "http://h:1/") is None
    assert run_example(_ex("exit 0", lang="bash"), "http://h:1") is None
    assert run_example(_ex('echo "${LOGPROBE_URL:-http://127.0.0.1:8000}"', "bash", "http://h:1\n"),
                       "http://h:1") is None
    failed = run_example(_ex("import sys; print('out'); sys.exit('boom')"), "http://h:1")
    assert "'t' (python) at docs/t.md:3 exited with status 1" in failed
    assert "--- stdout ---\nout" in failed and "boom" in failed
    mismatch = run_example(_ex("print(2)", expected="1...\n"), "http://h:1")
    assert "does not match the expected block at docs/t.md:7" in mismatch and "--- expected ---\n1..." in mismatch
    slow = run_example(_ex("import time; print('started', flush=True); time.sleep(600)"), "http://h:1", timeout=10)
    assert "timed out after 10 s" in slow and "started" in slow


def test_runner_fails_an_example_that_passed_on_a_retry():
    """The openai SDK retries a 500 twice by default; an example that passes only thanks to a retry fails."""
    import http.server
    import json
    import threading

    answers = [500, 200]

    class Flaky(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status = answers.pop(0) if answers else 200
            body = json.dumps({"error": {"message": "boom"}} if status == 500 else {
                "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}]}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = ("import os\nfrom openai import OpenAI\n"
            "client = OpenAI(base_url=os.environ['LOGPROBE_URL'] + '/v1', api_key='none')\n"
            "print(client.completions.create(model='m', prompt='p').choices[0].text)\n")
    try:
        failed = run_example(_ex(code, expected=" ok\n"), f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert not answers  # the SDK did retry
    assert failed is not None and "passed only after the openai SDK retried a request" in failed


def test_runner_uses_this_interpreter():
    assert run_example(_ex(f"import sys; assert sys.executable == {sys.executable!r}"), "http://h:1") is None


def test_marker_quoted_in_inline_code_is_prose():
    examples, errors = parse_examples("Put a line `<!-- example: NAME -->` before the block.\n", "x.md")
    assert examples == [] and errors == []
    _, errors = parse_examples("Put a line <!-- example NAME --> before the block.\n", "x.md")
    assert errors and "malformed example marker" in errors[0]
