"""The documentation's runnable examples: found in README.md and docs/**/*.md, run against a server.

The convention (the docs are written to it):

* A runnable example is a fenced code block whose info string is ``python`` or ``bash``, immediately
  preceded (blank lines aside) by a line ``<!-- example: NAME -->``; NAME is letters, digits and
  hyphens, unique across all the files.
* Its expected output is the next fenced block after it when that block's info string is ``text``;
  an example without one only has to exit 0.
* The output is compared as doctest does, with ELLIPSIS and NORMALIZE_WHITESPACE (``...`` matches
  anything, runs of whitespace are equal); a decimal number shown matches one within one unit of its
  last shown digit (``check_output``: the last bits of float32 sums differ between CPUs' kernels).
* A program reads the server's address from LOGPROBE_URL (``http://127.0.0.1:8000`` when unset; bash:
  ``"${LOGPROBE_URL:-http://127.0.0.1:8000}"``). The runner sets it to the test server (no trailing
  slash), sets MPLBACKEND=Agg, drops OPENAI_API_KEY / OPENAI_BASE_URL (an example must not rely on the
  reader's environment), and runs each example in a fresh temporary working directory:
  ``python -c CODE`` or ``bash -c CODE``, 600 s at most.
* An example shows the openai SDK as a reader writes it, with its default retries; the runner sets
  OPENAI_LOG=info and fails an example whose log shows a retry (a retry would hide a server error).

Importable from any test folder: pytest puts tests/ on sys.path for tests/conftest.py.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = {"python": [sys.executable, "-c"], "bash": ["bash", "-c"]}
TIMEOUT_S = 600  # a ceiling against a hung example, not a measure of speed: a loaded machine is slow
RETRY_LOG = "Retrying request"  # what the openai SDK logs, at level info, before it retries

_OPEN = re.compile(r"^([ \t]*)(`{3,}|~{3,})(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*example:\s*([A-Za-z0-9-]+)\s*-->\s*$")
_MARKER_LIKE = re.compile(r"<!--\s*examples?\b", re.IGNORECASE)  # a marker mistyped


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/**/*.md, in a stable order."""
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    docs = root / "docs"
    if docs.is_dir():
        files += sorted(p for p in docs.rglob("*.md") if p.is_file())
    return files


def rel(path: Path, root: Path = ROOT) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------------
# Fenced code blocks


@dataclass
class Fence:
    info: str  # the whole info string, stripped
    lang: str  # its first word, lowercased ("" when none)
    line: int  # 1-based line of the opening fence
    end_line: int  # line of the closing fence (the last line when unclosed)
    body: str  # the content, verbatim (less the opening fence's indentation)
    closed: bool


def scan(text: str) -> list[tuple[int, str] | Fence]:
    """The document as a sequence of ``(line_number, line)`` for lines outside fences and `Fence`s.

    Fences follow CommonMark: three or more backticks or tildes open one (a backtick fence's info
    string has no backtick); a line of the same character, at least as long and with nothing after it,
    closes it; everything between is kept verbatim (shorter or other fences inside included). An
    unclosed fence runs to the end of the document.
    """
    lines = text.splitlines()
    out: list[tuple[int, str] | Fence] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m or (m.group(2)[0] == "`" and "`" in m.group(3)):
            out.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence, info = len(m.group(1).expandtabs(4)), m.group(2), m.group(3).strip()
        close = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(indent, strip):])
            j += 1
        closed = j < len(lines)
        out.append(Fence(info=info, lang=(info.split() or [""])[0].lower(), line=i + 1,
                         end_line=j + 1 if closed else len(lines),
                         body="\n".join(body) + ("\n" if body else ""), closed=closed))
        i = j + 1
    return out


def outside_fences(text: str) -> list[str]:
    """The document's lines with every fenced block's lines (fences included) blanked out."""
    lines = text.splitlines()
    for item in scan(text):
        if isinstance(item, Fence):
            for k in range(item.line - 1, item.end_line):
                lines[k] = ""
    return lines


# ---------------------------------------------------------------------------------------------------
# Examples


@dataclass
class Example:
    name: str
    path: Path
    line: int  # the code block's opening fence
    marker_line: int
    lang: str
    code: str
    expected: str | None  # None: only the exit status counts
    expected_line: int | None

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"

    def __repr__(self) -> str:  # pytest shows it in failures
        return f"Example({self.name!r} at {self.where}, {self.lang})"


def parse_examples(text: str, path: Path | str = "<string>") -> tuple[list[Example], list[str]]:
    """The examples in one markdown text, and its errors as ``"file:line: message"`` strings."""
    path = Path(path)
    where = rel(path)
    examples: list[Example] = []
    errors: list[str] = []
    pending: tuple[str, int] | None = None  # a marker still waiting for its code block
    awaiting: Example | None = None  # an example whose next fence may be its expected output
    for item in scan(text):
        if isinstance(item, Fence):
            if not item.closed:
                errors.append(f"{where}:{item.line}: unclosed code fence (it swallows the rest of the file)")
            if pending is not None:
                name, mline = pending
                pending = None
                if item.lang in RUNNERS:
                    awaiting = Example(name=name, path=path, line=item.line, marker_line=mline,
                                       lang=item.lang, code=item.body, expected=None, expected_line=None)
                    examples.append(awaiting)
                    continue
                errors.append(f"{where}:{mline}: example {name!r} is followed by a ```{item.info} block "
                              f"(line {item.line}); it must be ```python or ```bash")
            elif awaiting is not None and item.lang == "text":
                awaiting.expected, awaiting.expected_line = item.body, item.line
            awaiting = None
            continue
        lineno, line = item
        m = _MARKER.match(line)
        if m:
            if pending is not None:
                errors.append(f"{where}:{pending[1]}: example {pending[0]!r} is not followed by a "
                              f"```python or ```bash block (another marker comes first, line {lineno})")
            pending = (m.group(1), lineno)
            continue
        if _MARKER_LIKE.search(re.sub(r"`[^`]*`", "", line)):  # a marker quoted in inline code is prose
            errors.append(f"{where}:{lineno}: malformed example marker {line.strip()!r}; write it alone on "
                          "its line as <!-- example: NAME --> (NAME: letters, digits, hyphens)")
            continue
        if pending is not None and line.strip():
            errors.append(f"{where}:{pending[1]}: example {pending[0]!r} is not followed by a "
                          f"```python or ```bash block (text comes first, line {lineno})")
            pending = None
    if pending is not None:
        errors.append(f"{where}:{pending[1]}: example {pending[0]!r} is not followed by a "
                      "```python or ```bash block (the file ends)")
    return examples, errors


def collect(files: list[Path] | None = None) -> tuple[list[Example], list[str]]:
    """Every example in `files` (default: the project's docs) and every error, duplicates included."""
    examples: list[Example] = []
    errors: list[str] = []
    seen: dict[str, Example] = {}
    for path in doc_files() if files is None else files:
        found, errs = parse_examples(Path(path).read_text(encoding="utf-8"), path)
        errors += errs
        for ex in found:
            if ex.name in seen:
                errors.append(f"{ex.where}: example name {ex.name!r} already used at {seen[ex.name].where}")
                continue
            seen[ex.name] = ex
            examples.append(ex)
    return examples, errors


# ---------------------------------------------------------------------------------------------------
# Running


# A decimal number in an expected output: digits, thousands commas, a fractional part, maybe an exponent,
# maybe followed by "..." (its digits were cut, not rounded). Not part of a dotted run ("127.0.0.1").
_WANT_NUMBER = re.compile(r"(?<![\w.])(-?\d{1,3}(?:,\d{3})+\.\d+|-?\d+\.\d+)([eE][-+]?\d+)?(\.\.\.)?(?![\w]|\.\d)")
_GOT_NUMBER = r"(-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)"


def check_output(want: str, got: str) -> bool:
    """doctest's comparison (ELLIPSIS, NORMALIZE_WHITESPACE), or else the same text with each decimal
    number in ``want`` matching a number within one unit of its last shown digit: ``-2.9738...``
    (digits cut) matches what cuts to -2.9737 to -2.9739, ``11,640.5`` (rounded) what rounds to 11,640.4
    to 11,640.6. The last bits of a float32 sum differ between CPUs' kernels (docs/development.md);
    integers, text and the numbers' order are still compared exactly."""
    if doctest.OutputChecker().check_output(want, got, doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE):
        return True
    return _numbers_near(want, got)


def _numbers_near(want: str, got: str) -> bool:
    pattern, shown = [], []
    pos = 0
    want = want.strip()
    for m in _WANT_NUMBER.finditer(want):
        pattern.append(_literal(want[pos:m.start()]))
        pattern.append(_GOT_NUMBER)
        shown.append(m)
        pos = m.end()
    if not shown:
        return False
    pattern.append(_literal(want[pos:]))
    found = re.fullmatch("".join(pattern), got.strip(), re.DOTALL)
    if found is None:
        return False
    return all(_near(m, value) for m, value in zip(shown, found.groups()))


def _literal(text: str) -> str:
    """doctest's reading of expected text as a regular expression: "..." anything, whitespace any run."""
    parts = []
    for i, piece in enumerate(text.split("...")):
        if i:
            parts.append(".*?")
        parts.append(r"\s+".join(re.escape(w) for w in re.split(r"\s+", piece)))
    return "".join(parts)


def _near(m: re.Match, got: str) -> bool:
    digits, exponent, cut = m.group(1), m.group(2) or "", m.group(3)
    places = len(digits.split(".")[1]) - (int(exponent[1:]) if exponent else 0)
    try:
        value = Decimal(got.replace(",", ""))
    except InvalidOperation:
        return False
    rounding = ROUND_DOWN if cut else ROUND_HALF_EVEN
    units = (value.scaleb(places)).to_integral_value(rounding=rounding)
    return abs(units - Decimal(digits.replace(",", "") + exponent).scaleb(places)) <= 1


def example_env(base_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")}
    env["LOGPROBE_URL"] = base_url.rstrip("/")
    env["MPLBACKEND"] = "Agg"
    env["OPENAI_LOG"] = "info"
    env["PYTHONUNBUFFERED"] = "1"
    # A proxy in the environment must not take the requests to the local server.
    for key in ("NO_PROXY", "no_proxy"):
        env[key] = ",".join(x for x in (env.get(key, ""), "127.0.0.1,localhost") if x)
    return env


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else b


def run_example(ex: Example, base_url: str, timeout: float = TIMEOUT_S) -> str | None:
    """Run one example; None when it passes, else a report naming it, its place, stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix=f"doc-example-{ex.name}-") as cwd:
        try:
            proc = subprocess.run(RUNNERS[ex.lang] + [ex.code], cwd=cwd, env=example_env(base_url),
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return _report(ex, f"timed out after {timeout:g} s", _text(e.stdout), _text(e.stderr))
    out, err = _text(proc.stdout), _text(proc.stderr)
    if proc.returncode != 0:
        return _report(ex, f"exited with status {proc.returncode}", out, err)
    if RETRY_LOG in err:
        return _report(ex, "passed only after the openai SDK retried a request", out, err)
    if ex.expected is not None and not check_output(ex.expected, out):
        return _report(ex, f"output does not match the expected block at {rel(ex.path)}:{ex.expected_line}",
                       out, err, want=ex.expected)
    return None


def _report(ex: Example, what: str, out: str, err: str, want: str | None = None) -> str:
    parts = [f"doc example {ex.name!r} ({ex.lang}) at {ex.where} {what}"]
    if want is not None:
        parts.append("--- expected ---\n" + want.rstrip("\n"))
    parts.append("--- stdout ---\n" + out.rstrip("\n"))
    parts.append("--- stderr ---\n" + err.rstrip("\n"))
    return "\n".join(parts)
