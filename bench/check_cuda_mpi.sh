#!/usr/bin/env bash
# Check a build of bench/build_cuda_mpi.sh on a machine without a GPU: all but the CUDA part.
#
#     bash bench/check_cuda_mpi.sh PREFIX
#
# From a copy of PREFIX in another directory, PREFIX itself moved aside meanwhile (the install
# must be relocatable: the GPU machine gets it at another path), with the libcuda.so.1 stub of PREFIX/lib/stubs standing in for a
# driver: mpichversion names --with-cuda; libmpi resolves every library it needs inside the
# copy; the mpi4py wheel of PREFIX/wheels, unpacked (no pip, no venv), imports against it; and
# 2 ranks under the copy's own mpiexec allreduce host memory, blocking and nonblocking, with
# MPI_THREAD_MULTIPLE. MPIR_CVAR_ENABLE_GPU=0: with the stub, MPI start-up dies in CUDA (a
# segfault). Device memory is left to bench/gpu_validate.sh on a GPU.
set -euo pipefail
prefix=$(realpath "${1:?usage: check_cuda_mpi.sh PREFIX}")
python=${PYTHON:-python3}
scratch=$(mktemp -d)
moved=$scratch/moved/cuda-mpi
mkdir -p "$scratch/moved" "$scratch/site"
cp -a "$prefix" "$moved"
mv "$prefix" "$prefix.aside"  # nothing may reach the path it was built for
trap 'mv "$prefix.aside" "$prefix"; rm -rf "$scratch"' EXIT
"$python" -m zipfile -e "$moved"/wheels/mpi4py-*.whl "$scratch/site"
export LD_LIBRARY_PATH=$moved/lib:$moved/lib/stubs PYTHONPATH=$scratch/site MPIR_CVAR_ENABLE_GPU=0

"$moved/bin/mpichversion" | grep -E 'Version|Device|configure'
"$moved/bin/mpichversion" | grep -q -- '--with-cuda=' || { echo "FAIL: no --with-cuda" >&2; exit 1; }
ldd "$moved/lib/libmpi.so" | tee "$scratch/ldd" | grep -E 'cuda|mpi'
if grep -q 'not found' "$scratch/ldd" || grep -E 'cuda|mpi' "$scratch/ldd" | grep -qv "$moved"; then
    echo "FAIL: libmpi needs a library outside the copy" >&2; exit 1
fi

cat > "$scratch/allreduce.py" <<'EOF'
import array
import mpi4py
from mpi4py import MPI

comm = MPI.COMM_WORLD
size, rank = comm.Get_size(), comm.Get_rank()
assert MPI.Query_thread() == MPI.THREAD_MULTIPLE, MPI.Query_thread()
n = 1 << 20  # 8 MiB of float64: past the eager limit
mine = array.array("d", [rank + 1.0]) * n
want = size * (size + 1) / 2
total = array.array("d", [0.0]) * n
comm.Allreduce(mine, total, op=MPI.SUM)
assert set(total) == {want}, set(total)
total = array.array("d", [0.0]) * n
comm.Iallreduce(mine, total, op=MPI.SUM).Wait()
assert set(total) == {want}, set(total)
if rank == 0:
    print("mpi4py", mpi4py.__version__, "from", mpi4py.__file__)
    print(MPI.Get_library_version().splitlines()[0])
    print(f"{size} ranks: Allreduce and Iallreduce of {n} float64 (host) = {want}: ok")
EOF
timeout 120 "$moved/bin/mpiexec" -n 2 "$python" "$scratch/allreduce.py"
echo "checked: $prefix (copied to $moved) without a GPU"
