"""Step times of several mpidp versions in one run, the versions taking turns.

    python bench/versions.py 145e12b 8d46a97 .            # '.': the working tree
    python bench/versions.py 145e12b . --models mlp --passes 5 --no-allreduce
    python bench/versions.py 3a057ee . --models --passes 9   # the backend's all_reduce only

For each pass, each model and each version: ``mpiexec -n 2 train_bench.py`` (the
version's own benchmark and ``mpidp``, from a ``git worktree`` of it) with the modes
``local``, ``mpidp`` and ``ddp-mpidp`` (torch's DDP over the version's "mpidp"
backend; left out where that version's benchmark has no such mode), then
``backend_bench.py allreduce`` where the version has it. Versions
alternate within every pass, so machine noise hits all alike. Prints, per model and
mode, each version's median step over the passes, its ratio to the local (compute
only) step of the same launch, and its ratio to the first version's; the backend's
all_reduce per size likewise, and each method's ratio to raw mpi4py in the same launch
(which machine load moves far less than the times themselves). Raw lines go to ``--out`` (JSON lines). A regression
such as mlp's 1.18x (issue 17) shows as a ratio to the first version above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def tree_of(rev: str) -> Path:
    """The source tree of ``rev``: the working tree for '.', else a worktree made once."""
    if rev == ".":
        return ROOT
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"mpidp-version-{sha}"
    if not (path / "mpidp").is_dir():
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(path), sha],
                       cwd=ROOT, check=True, capture_output=True)
    return path


def knows(tree: Path, script: str, word: str = "") -> bool:
    """Whether ``tree``'s bench ``script`` exists (and mentions ``word``)."""
    path = tree / "bench" / script
    return path.exists() and f'"{word}' in path.read_text()


def launch(tree: Path, script: str, *args: str, out: Path) -> list[dict]:
    """Run ``tree``'s bench ``script`` with ``tree``'s mpidp; return its JSON lines."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(tree), str(tree / "bench")]))
    command = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", sys.executable,
               str(tree / "bench" / script), *args, "--out", str(out)]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        print(f"  {tree.name}: {script} failed:\n{result.stderr[-1500:]}", file=sys.stderr)
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="git revisions; '.' is the working tree")
    parser.add_argument("--models", nargs="*", default=["mlp", "wide", "cnn"])
    parser.add_argument("--modes", nargs="+", default=["local", "mpidp", "ddp-mpidp"])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-allreduce", action="store_true")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "mpidp-versions.jsonl"))
    args = parser.parse_args()
    trees = {rev: tree_of(rev) for rev in args.revs}
    scratch = Path(tempfile.gettempdir()) / "mpidp-versions-one.jsonl"
    steps: dict = {}  # (model, mode, rev) -> [median_ms per pass]
    ratios: dict = {}  # (model, mode, rev) -> [median / local median per pass]
    allreduce: dict = {}  # (bytes, method, rev) -> [us per pass]
    raw_mpi: dict = {}  # (bytes, method, rev) -> [us / mpi4py's us, same launch, per pass]
    with open(args.out, "a") as raw:
        for n in range(args.passes):
            for model in args.models:
                for rev, tree in trees.items():
                    modes = [m for m in args.modes if knows(tree, "train_bench.py", m.split(":")[0])]
                    records = launch(tree, "train_bench.py", "--model", model, "--steps",
                                     str(args.steps), "--modes", *modes, out=scratch)
                    local = next((r["median_ms"] for r in records if r["mode"] == "local"), None)
                    for r in records:
                        steps.setdefault((model, r["mode"], rev), []).append(r["median_ms"])
                        if local:
                            ratios.setdefault((model, r["mode"], rev), []).append(
                                r["median_ms"] / local)
                        raw.write(json.dumps(dict(r, rev=rev, pass_=n)) + "\n")
                    print(f"pass {n + 1} {model} {rev}: " + ", ".join(
                        f"{r['mode']} {r['median_ms']:.1f} ms" for r in records), flush=True)
            if args.no_allreduce:
                continue
            for rev, tree in trees.items():
                if not knows(tree, "backend_bench.py"):
                    continue
                for r in launch(tree, "backend_bench.py", "allreduce", out=scratch):
                    for method, us in r["us"].items():
                        allreduce.setdefault((r["bytes"], method, rev), []).append(us)
                        if r["us"].get("mpi4py"):
                            raw_mpi.setdefault((r["bytes"], method, rev), []).append(
                                us / r["us"]["mpi4py"])
                    raw.write(json.dumps(dict(r, rev=rev, pass_=n)) + "\n")
    print(f"\nstep time, median of {args.passes} passes (ms); x local: over the compute-only "
          "step of the same launch; then over the first version that has the mode")
    print(f"{'model':<8} {'mode':<10} " + " ".join(f"{rev:>26}" for rev in args.revs))
    for model in args.models:
        for mode in args.modes:
            cells = []
            for rev in args.revs:
                values = steps.get((model, mode, rev))
                if not values:
                    cells.append(f"{'-':>26}")
                    continue
                ms = statistics.median(values)
                base = next((steps[(model, mode, r)] for r in args.revs
                             if (model, mode, r) in steps), None)
                vs_first = ms / statistics.median(base) if base else float("nan")
                vs_local = statistics.median(ratios.get((model, mode, rev), [float("nan")]))
                cells.append(f"{ms:8.1f} ({vs_local:4.2f}x l, {vs_first:4.2f}x)")
            print(f"{model:<8} {mode:<10} " + " ".join(cells))
    if allreduce:
        print("\nbackend all_reduce per call, median of passes (us); x: over the first version "
              "that has it; r: over raw mpi4py in the same launch")
        for size in sorted({key[0] for key in allreduce}):
            for method in sorted({key[1] for key in allreduce if key[0] == size}):
                cells = []
                for rev in args.revs:
                    values = allreduce.get((size, method, rev))
                    base = next((allreduce[(size, method, r)] for r in args.revs
                                 if (size, method, r) in allreduce), None)
                    if not values:
                        cells.append(f"{'-':>28}")
                        continue
                    us = statistics.median(values)
                    raw = statistics.median(raw_mpi.get((size, method, rev), [float("nan")]))
                    cells.append(f"{us:9.1f} ({us / statistics.median(base):4.2f}x, {raw:5.2f}r)")
                print(f"{size:>10} B {method:<11} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
