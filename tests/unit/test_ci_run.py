"""tests/ci.py, the README's test command: a range end whose first build failed is built again in a new
environment, so a package half-installed by the failed build (a download cut off, a full disk) cannot
reach its tests; and the two ends' builds run side by side only where the disk holds both."""

from __future__ import annotations

import importlib.util
import subprocess
import threading
import time
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
    ci.run_range(part, "lowest", False, ci.Disk(free=lambda: 7 * 2**30))
    assert builds == [None, None]  # the second build found no environment: the failed one was removed
    assert part.code == 0 and len(ran) == 1 and ran[0][0] == str(tmp_path / ".venv-range-lowest" / "bin" / "python")
    assert part.notes == ["first build failed (pip install torch==2.6 ... exited 1: [Errno 28] No space left "
                          "on device; 7.0 GiB free); building again"]


def test_a_build_that_fails_twice_fails_the_run_with_its_reason(tmp_path, monkeypatch):
    ci = load_ci()
    ranges = ci.version_ranges
    monkeypatch.setattr(ranges, "env_dir_of", lambda end: tmp_path / f".venv-range-{end}")

    def build(end):
        raise ranges.PipFailed("highest: the environment was built but does not import: ImportError: libcudnn.so.9")

    monkeypatch.setattr(ranges, "build", build)
    part = ci.Part("highest end")
    ci.run_range(part, "highest", False, ci.Disk())
    assert part.code == 1 and part.notes[-1].startswith("PipFailed: highest: the environment was built but does not")
    assert part.notes[0].startswith("first build failed (highest: the environment was built") and len(part.notes) == 2


def builds_side_by_side(ci, disk, retry: bool = False) -> list[str]:
    """What happened, in order, when the lowest end's build held its room while the highest end's asked
    for its own (`retry`: the highest end's second build, which waits for no other to be under way)."""
    events, holding, let_go = [], threading.Event(), threading.Event()
    highest = ci.Part("highest end")

    def lowest_build():
        with disk.room("lowest", ci.Part("lowest end")):
            events.append("lowest starts")
            holding.set()
            let_go.wait()
            events.append("lowest ends")

    def highest_build():
        holding.wait()
        with disk.room("highest", highest, alone=retry):
            events.append("highest starts")

    threads = [threading.Thread(target=lowest_build), threading.Thread(target=highest_build)]
    for thread in threads:
        thread.start()
    holding.wait()
    give_up = time.monotonic() + 300  # bounds a hang (a build that neither starts nor waits), not a speed
    while "highest starts" not in events and "highest" not in disk.waiting:
        assert time.monotonic() < give_up, "the highest end's build neither started nor waited"
        time.sleep(0.01)  # the highest end has either started or is waiting: nothing else can happen
    let_go.set()
    for thread in threads:
        thread.join()
    return events + highest.notes


def test_the_second_build_waits_where_the_disk_holds_one():
    ci = load_ci()
    events = builds_side_by_side(ci, ci.Disk(free=lambda: int(1.9 * ci.BUILD_ROOM)))
    assert events[:3] == ["lowest starts", "lowest ends", "highest starts"]
    assert len(events) == 4 and events[3].startswith("built once the other end's build was done (")


def test_both_build_at_once_where_the_disk_holds_both():
    ci = load_ci()
    events = builds_side_by_side(ci, ci.Disk(free=lambda: 2 * ci.BUILD_ROOM))
    assert events == ["lowest starts", "highest starts", "lowest ends"]


def test_a_second_try_waits_for_the_other_build_whatever_the_disk_holds():
    ci = load_ci()
    events = builds_side_by_side(ci, ci.Disk(free=lambda: 100 * ci.BUILD_ROOM), retry=True)
    assert events[:3] == ["lowest starts", "lowest ends", "highest starts"]
