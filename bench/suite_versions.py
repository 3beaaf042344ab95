"""The same launched check-file tests under two versions, taking turns: is the suite slower?

    python bench/suite_versions.py 3a057ee . --passes 7
    python bench/suite_versions.py 3a057ee . --files tests/mpi/check_zero.py

Each pass runs, for each version (a ``git worktree`` of it, '.' the working tree, as
``bench/versions.py`` makes them), ``mpiexec -n 2 python -m pytest FILES`` with that
version's mpidp and tests, and reads rank 0's per-test times (JUnit XML). It prints,
per version and per file, the median over passes of the summed times of the tests that
ran (not skipped) in every pass of both versions, and the ratio to the first version.
The tests' own bodies may differ between versions; a ratio is the engine's only where
the tests are the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from versions import tree_of

FILES = ["tests/mpi/check_comm.py", "tests/mpi/check_comm_errors.py", "tests/mpi/check_backend.py",
         "tests/mpi/check_ddp.py", "tests/mpi/check_horovod.py", "tests/mpi/check_zero.py"]


def times(tree: Path, files: list[str], out: Path) -> dict[str, float]:
    """Rank 0's seconds per test that ran, of one 2-rank launch of ``files`` in ``tree``."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    script = (f'exec {sys.executable} -m pytest -q -p no:cacheprovider {" ".join(files)} '
              f'--junitxml={out}-$PMI_RANK.xml')
    subprocess.run([str(mpiexec), "-n", "2", "bash", "-c", script], cwd=tree, env=env,
                   capture_output=True, timeout=900)
    return {case.get("classname") + "::" + case.get("name"): float(case.get("time"))
            for case in ET.parse(f"{out}-0.xml").getroot().iter("testcase")
            if case.find("skipped") is None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs=2, help="git revisions; '.' is the working tree")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--files", nargs="+", default=FILES)
    args = parser.parse_args()
    trees = {rev: tree_of(rev) for rev in args.revs}
    out = Path(tempfile.gettempdir()) / "mpidp-suite-versions"
    runs: dict[str, list[dict]] = {rev: [] for rev in args.revs}
    for n in range(args.passes):
        for rev, tree in trees.items():
            runs[rev].append(times(tree, args.files, out))
        print(f"pass {n + 1} done", flush=True)
    common = set.intersection(*(set(run) for rev in args.revs for run in runs[rev]))
    groups = {"all": common} | {f: {t for t in common if t.startswith(Path(f).stem + "::")
                                    or t.split("::")[0].endswith("." + Path(f).stem)}
                                for f in args.files}
    print(f"{len(common)} tests ran in every pass of both; median over passes of their summed seconds")
    for name, tests in groups.items():
        medians = [statistics.median(sum(run[t] for t in tests) for run in runs[rev])
                   for rev in args.revs]
        ratio = medians[1] / medians[0] if medians[0] else float("nan")
        print(f"{name:<36} {len(tests):4d} tests " + " ".join(f"{m:8.2f} s" for m in medians)
              + f"  {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
