"""The tests that exercise transformers, under the lowest transformers version pyproject.toml declares.

    python tests/lowest_transformers.py [pytest arguments]

The main test run uses the newest version pip resolves (the top of the range); this one makes the
bottom of the range a tested promise too. It creates `.venv-lowest` beside this checkout (with the main
environment's packages visible, so torch and logprobe itself come from there), installs
`transformers==<the lower bound>` into it, with the versions of its own dependencies that pip resolves
for it, and runs tests/unit, tests/model and tests/api there (the GGUF is dequantized again: the cache
directory is per transformers version). README's test command runs it after the main suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lowest_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"transformers>=([0-9.]+)', text)
    if match is None:
        raise SystemExit("pyproject.toml declares no lower bound for transformers")
    return match.group(1)


def main() -> int:
    version = lowest_version()
    env_dir = ROOT / ".venv-lowest"
    python = env_dir / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"transformers=={version}"], check=True)
    found = subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"],
                           check=True, capture_output=True, text=True).stdout.strip()
    if found != version:
        raise SystemExit(f"expected transformers {version} in {env_dir}, found {found}")
    print(f"tests under the lowest declared transformers, {found}", flush=True)
    args = sys.argv[1:] or ["tests/unit", "tests/model", "tests/api", "-q", "-p", "no:cacheprovider"]
    return subprocess.run([str(python), "-m", "pytest", *args], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
