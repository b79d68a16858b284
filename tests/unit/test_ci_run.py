"""tests/ci.py, the README's test command: a range end whose first build failed is built again in a new
environment, so a package half-installed by the failed build (a download cut off, a full disk) cannot
reach its tests."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def load_ci():
    spec = importlib.util.spec_from_file_location("logprobe_ci_run", TESTS / "ci.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts tests/ on sys.path for its `import version_ranges`
    return module


def test_a_failed_build_is_built_again_in_a_new_environment(tmp_path, monkeypatch):
    ci = load_ci()
    ranges = ci.version_ranges
    monkeypatch.setattr(ranges, "env_dir_of", lambda end: tmp_path / f".venv-range-{end}")
    builds, ran = [], []

    def build(end):
        env = ranges.env_dir_of(end)
        builds.append(sorted(p.name for p in env.iterdir()) if env.exists() else None)
        if len(builds) == 1:  # the first build leaves a package half-installed, then fails
            (env / "torch").mkdir(parents=True)
            raise ranges.PipFailed("pip install torch==2.6 ... exited 1: [Errno 28] No space left on device")
        return env / "bin" / "python"

    monkeypatch.setattr(ranges, "build", build)
    monkeypatch.setattr(ci.subprocess, "run", lambda command, **kw: ran.append(command) or
                        subprocess.CompletedProcess(command, 0))
    part = ci.Part("lowest end")
    ci.run_range(part, "lowest", quiet=False)
    assert builds == [None, None]  # the second build found no environment: the failed one was removed
    assert part.code == 0 and len(ran) == 1 and ran[0][0] == str(tmp_path / ".venv-range-lowest" / "bin" / "python")
    assert part.notes == ["first build failed (pip install torch==2.6 ... exited 1: [Errno 28] No space left "
                          "on device); building again"]


def test_a_build_that_fails_twice_fails_the_run_with_its_reason(tmp_path, monkeypatch):
    ci = load_ci()
    ranges = ci.version_ranges
    monkeypatch.setattr(ranges, "env_dir_of", lambda end: tmp_path / f".venv-range-{end}")

    def build(end):
        raise ranges.PipFailed("highest: the environment was built but does not import: ImportError: libcudnn.so.9")

    monkeypatch.setattr(ranges, "build", build)
    part = ci.Part("highest end")
    ci.run_range(part, "highest", quiet=False)
    assert part.code == 1 and part.notes[-1].startswith("PipFailed: highest: the environment was built but does not")
    assert part.notes[0].startswith("first build failed (highest: the environment was built") and len(part.notes) == 2
