"""The whole test run, as the README's test command gives it: the suite, and the unit, model and API
tests at both ends of every dependency range (tests/version_ranges.py), side by side.

    python tests/ci.py [--workers N] [--serial]

- The suite runs on N pytest-xdist workers (default: the machine's logical CPUs, at least 2), a module's
  tests on one worker (`--dist loadfile`: its fixtures are built once), the modules in the order
  collected (`--no-loadscope-reorder`), which tests/conftest.py makes the longest first.
- While it runs, the two range environments are built (`pip install`: downloads and unpacking, mostly
  waiting), then their tests start at a lower CPU priority (`nice`): they take the time the suite's
  workers leave, while a worker waits on a server or a subprocess, and all of it once the suite is done.
  Their output goes to a file each and is printed whole when they end.
- Side by side, every test process computes on one thread (`OMP_NUM_THREADS=1`, unless the caller set
  it; the servers and CLI processes the tests start inherit it): several processes whose torch each
  keeps a team of OpenMP threads as large as the machine make those threads wait on each other at
  every parallel region. Measured on 2 vCPUs, four processes of small matrix products: 10 s each on one
  thread, 64-77 s each on two. The tests that ask for two threads themselves (a server's thread count on
  2 vCPUs: the kernels' paths differ) wait at their parallel regions without spinning
  (`OMP_WAIT_POLICY=PASSIVE`): a thread that spins while its partner waits for a CPU burns the time the
  partner needs. Measured on 2 vCPUs with one core busy at normal priority, two processes at nice 19
  each running the 2-thread attention tests (tests/model/test_attention_reads.py): 202 s each spinning,
  16 s each passive; in the range ends of a CI run four such tests had taken 56-285 s each.
- The disk: a range environment takes ~9-10 GiB while pip builds it and ~6 GiB once built (PyPI's torch
  build carries CUDA's libraries; tests/version_ranges.py). The second build starts beside the first
  only where the free space holds both (`BUILD_ROOM` each, counted from the space free when it would
  start); else it waits for the first to end. A build that fails (a full disk, a download cut off) is
  built again in a new environment once no other build is under way. The free space under the checkout
  is printed at the end: at the start, and the least seen (every 5 s).
- `--serial` runs the three parts one after another, the suite on one process, torch on its own default
  threads.
- `--coverage` runs the suite under coverage.py (`[tool.coverage.run]` in pyproject.toml: the server and CLI
  processes the tests start are measured too) and prints its line coverage of src/ at the end. It is
  several times slower on Python-heavy tests: a measurement, not the CI run.

Every part's wall time is printed at the end, with the slowest tests of the suite (`--durations`, from
pyproject.toml) above it. The exit status is the first non-zero one of the parts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import version_ranges  # noqa: E402

ROOT = version_ranges.ROOT
ENDS = ["lowest", "highest"]
# The range ends' tests take the CPU the suite leaves: the lowest priority there is. Ray runs its workers
# at nice 15 (Ray Data's scoring actors, `RAY_worker_niceness`) and logprobe its Serve replicas at 10
# (cluster/ray_app.py): at nice 10 the range ends' tests took the suite's Ray workers' CPU, and its Ray
# Data module ran ~20 minutes instead of ~4.
NICE = 19
# One compute thread per test process when the parts run side by side, and passive waits where a test asks
# for more (above).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
# The free space one range environment's build is given (the most measured: 8.9 GiB at the lowest end,
# 9.3 GiB at the highest, downloads and unpacked files together; tests/version_ranges.py), with room for
# what the suite writes meanwhile.
GIB = 2**30
BUILD_ROOM = 11 * GIB


class Disk:
    """The free space under the checkout, and the range environments' builds under way: a build starts
    beside others only where the space holds each of them (`BUILD_ROOM`)."""

    def __init__(self, free=None):
        self.free = free or (lambda: shutil.disk_usage(ROOT).free)
        self.changed = threading.Condition()
        self.building: set[str] = set()
        self.waiting: set[str] = set()
        self.start = self.least = self.free()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.least = min(self.least, self.free())
            time.sleep(5)

    @contextlib.contextmanager
    def room(self, end: str, part: "Part", alone: bool = False):
        """Hold `end`'s build until the space holds it beside the builds under way (`alone`: until no
        other build is under way), then let it run."""
        with self.changed:
            since = time.monotonic()
            while self.building and (alone or self.free() < BUILD_ROOM * (1 + len(self.building))):
                self.waiting.add(end)
                self.changed.wait(timeout=5)
            if end in self.waiting:
                self.waiting.discard(end)
                part.notes.append(f"built once the other end's build was done ({time.monotonic() - since:.0f} s "
                                  f"of waiting; {self.free() / GIB:.1f} GiB free then)")
            self.building.add(end)
        try:
            yield
        finally:
            with self.changed:
                self.building.discard(end)
                self.changed.notify_all()


class Part:
    def __init__(self, name: str):
        self.name = name
        self.started = time.monotonic()
        self.built_s: float | None = None
        self.ended: float | None = None
        self.code: int | None = None
        self.log: Path | None = None
        self.notes: list[str] = []

    def wall(self) -> float:
        return (self.ended or time.monotonic()) - self.started


def run_range(part: Part, end: str, quiet: bool, disk: Disk) -> None:
    """Build the environment of one end of the ranges, then run its tests (output to a file when quiet)."""
    try:
        try:
            with disk.room(end, part):
                python = version_ranges.build(end)
        except (version_ranges.PipFailed, subprocess.CalledProcessError) as error:
            # A download cut off mid-way (each end fetches torch's several-GB PyPI build), or a disk
            # that filled while both ends were building, is not a defect of the code under test: build
            # once more, in a new environment (the failed one may hold a package half-installed), once
            # no other build is under way, and say so.
            part.notes.append(f"first build failed ({error}; {disk.free() / GIB:.1f} GiB free); building again")
            print(f"{end} end: {part.notes[-1]}", flush=True)
            version_ranges.discard(end)
            with disk.room(end, part, alone=True):
                python = version_ranges.build(end)
        part.built_s = time.monotonic() - part.started
        command = [str(python), "-m", "pytest", *version_ranges.TESTS]
        if quiet:
            command = ["nice", "-n", str(NICE), *command]
            part.log = Path(tempfile.mkstemp(prefix=f"logprobe-range-{end}-", suffix=".log")[1])
            with open(part.log, "w", encoding="utf-8") as out:
                part.code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
        else:
            part.code = subprocess.run(command, cwd=ROOT).returncode
    except BaseException as error:  # a failed build fails the run, with its reason (repeated in the summary)
        part.notes.append(f"{type(error).__name__}: {error}")
        print(f"{end} end: {part.notes[-1]}", flush=True)
        part.code = 1
    finally:
        part.ended = time.monotonic()


def pytest_command(coverage: bool) -> list[str]:
    """The suite's pytest, under coverage.py ([tool.coverage.run] in pyproject.toml) when asked."""
    if coverage:
        for stale in ROOT.glob(".coverage*"):
            stale.unlink()
        return [sys.executable, "-m", "coverage", "run", "-m", "pytest"]
    return [sys.executable, "-m", "pytest"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=max(2, os.cpu_count() or 1),
                        help="pytest-xdist workers for the suite (default: logical CPUs, at least 2)")
    parser.add_argument("--serial", action="store_true", help="the three parts one after another, no workers")
    parser.add_argument("--coverage", action="store_true",
                        help="run the suite under coverage.py (much slower) and print its line coverage of src/")
    args = parser.parse_args()
    begin = time.monotonic()

    disk = Disk()
    suite = Part("suite")
    ranges = {end: Part(f"{end} end") for end in ENDS}
    threads = []
    if args.serial:
        suite.code = subprocess.run([*pytest_command(args.coverage), "-p", "no:xdist"], cwd=ROOT).returncode
        suite.ended = time.monotonic()
        for end in ENDS:
            ranges[end].started = time.monotonic()
            run_range(ranges[end], end, False, disk)
    else:
        for name, value in ONE_THREAD.items():
            os.environ.setdefault(name, value)
        for end in ENDS:
            thread = threading.Thread(target=run_range, args=(ranges[end], end, True, disk), daemon=True)
            thread.start()
            threads.append(thread)
        suite.code = subprocess.run([*pytest_command(args.coverage), "-n", str(args.workers), "--dist", "loadfile",
                                     "--no-loadscope-reorder"],
                                    cwd=ROOT).returncode
        suite.ended = time.monotonic()
        waiting = [end for end in ENDS if ranges[end].ended is None]
        if waiting:
            print(f"\nthe suite is done; waiting for the range tests ({', '.join(waiting)})", flush=True)
        for thread in threads:
            thread.join()
        for end in ENDS:
            part = ranges[end]
            if part.log is not None:
                print(f"\n{'=' * 30} {part.name} (tests/version_ranges.py --only {end}) {'=' * 30}", flush=True)
                print(part.log.read_text(encoding="utf-8", errors="replace"), flush=True)
                part.log.unlink()
            print(f"{end} end: pytest exited {part.code}", flush=True)

    if args.coverage:
        subprocess.run([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT)
        subprocess.run([sys.executable, "-m", "coverage", "report", "--precision=2", "--skip-covered"], cwd=ROOT)
    print("\nwall time of each part (s):", flush=True)
    for part in [suite, *ranges.values()]:
        built = f", environment built in {part.built_s:.0f}" if part.built_s is not None else ""
        print(f"  {part.name:>12}: {part.wall():7.0f}{built}; exit {part.code}", flush=True)
        for note in part.notes:
            print(f"  {'':>12}  {note}", flush=True)
    print(f"  {'disk':>12}: {disk.start / GIB:.1f} GiB free under the checkout at the start, "
          f"{disk.least / GIB:.1f} GiB at the least", flush=True)
    mode = "one after another" if args.serial else f"side by side, the suite on {args.workers} workers"
    print(f"  {'in all':>12}: {time.monotonic() - begin:7.0f} ({mode})", flush=True)
    return next((part.code for part in [suite, *ranges.values()] if part.code), 0)


if __name__ == "__main__":
    sys.exit(main())
