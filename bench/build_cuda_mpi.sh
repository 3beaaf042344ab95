#!/usr/bin/env bash
# Build a CUDA-aware MPICH and an mpi4py wheel against it, pinned and checksummed.
#
#     bash bench/build_cuda_mpi.sh PREFIX
#
# What it builds (every input pinned below; a download whose sha256 differs stops the build):
#   MPICH 4.0.2 from Debian bookworm's source package mpich 4.0.2-3 (the orig tarball: MPICH's
#     release with its modules: libfabric, yaksa, hwloc), configured --with-device=ch4:ofi
#     (embedded libfabric) --with-cuda=CUDA --with-cuda-sm=CUDA_SM: yaksa packs device buffers
#     with CUDA kernels, and MPICH's GPU-aware fallback reduces device buffers through host
#     copies (its GPU support matrix). No Fortran, no C++ bindings, no docs, stripped.
#     yaksa's generated pack code covers 2 levels of derived-type nesting (PUP_NESTING, yaksa's
#     default 3: five times the code and the compile time; deeper types still pack right, split
#     by yaksa's frontend), and each of its 279 CUDA files is compiled once, not twice.
#     Why 4.0.2 and not the 5.0.2 of the mpich wheel: the package registries this project
#     reaches serve Debian bookworm's sources (4.0.2) and no MPICH 5 source (PyPI's mpich has
#     wheels only). MPICH 4 and 5 share the MPICH ABI (libmpi.so.12), so mpi4py's wheel loads
#     either (MPI4PY_LIBMPI=PREFIX/lib/libmpi.so).
#   mpi4py 4.1.2 (the .venv's) from its sdist, built with PREFIX/bin/mpicc into PREFIX/wheels/,
#     for Python's stable ABI (cp310-abi3: any CPython >= 3.10, so the GPU machine's 3.12 too).
# Needs: apt-get (Debian's deb-src is read through a private source list: nothing on the
#   system changes), a C compiler, CUDA with nvcc (CUDA, default: the CUDA of the nvcc on PATH, as its dry run names it),
#   python3 with pip. No GPU: the kernels are compiled for CUDA_SM (default 90: H100, H200).
# CUDA 13 removed cudaDeviceProp.computeMode, which yaksa 4.0.2 reads once at start-up: the
#   script patches that one read to cudaDeviceGetAttribute(cudaDevAttrComputeMode).
# Jobs: JOBS (default twice the cores); every step under nice -n 19. Logs and the build tree: PREFIX.build/
#   (kept on failure, removed on success). At the end bench/check_cuda_mpi.sh checks all but
#   the CUDA part on this machine (no GPU needed).
#
# On a GPU machine: carry PREFIX (build/cuda-mpi, ignored by git) with the working tree and run
# MPI_PREFIX=build/cuda-mpi bash bench/gpu_validate.sh OUTDIR sanity path allreduce (docs/gpu.md).
# Use it: PATH=PREFIX/bin:$PATH LD_LIBRARY_PATH=PREFIX/lib MPI4PY_LIBMPI=PREFIX/lib/libmpi.so;
# `PREFIX/bin/mpichversion` names --with-cuda in its configure line, and `python -m mpidp info`
# reports "the MPI library reports CUDA support" on a GPU (MPIX_GPU_query_support).
set -euo pipefail

MPICH_VERSION=4.0.2
MPICH_DEBIAN=4.0.2-3
MPICH_SHA256=b27039f964afeb6b8a3e009c56b441cbe368c26d6d6476ad3bb7190996875860
MPI4PY_VERSION=4.1.2
MPI4PY_SHA256=56860286dc45f20e8821e93cb06669e30462348bf866f685553fa4b712d58d02

prefix=$(realpath -m "${1:?usage: build_cuda_mpi.sh PREFIX}")
here=$(dirname "$(realpath "$0")")
nvcc=$(command -v nvcc) || { echo "no nvcc on PATH: CUDA's compiler is needed" >&2; exit 1; }
# nvcc may be a wrapper script: its own dry run names the CUDA it belongs to (TOP=CUDA/bin/..)
top=$(echo | "$nvcc" --dryrun -x cu -c - -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')
cuda=$(realpath -m "${CUDA:-${top:-$(dirname "$(dirname "$nvcc")")}}")
[ -f "$cuda/include/cuda_runtime_api.h" ] || { echo "no $cuda/include/cuda_runtime_api.h: set CUDA" >&2; exit 1; }
sm=${CUDA_SM:-90}
jobs=${JOBS:-$(( 2 * $(nproc) ))}  # niced jobs wait on their neighbours: more of them than cores
python=${PYTHON:-python3}
work=$prefix.build
rm -rf "$work" "$prefix"
mkdir -p "$work/lists/partial"
cd "$work"
start=$(date +%s)
renice -n 19 -p $$ > /dev/null  # every step yields to the rest of a shared machine

# -- the source, checked ----------------------------------------------------------------------
printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > apt.sources
apt_opts=(-o Dir::Etc::sourcelist="$work/apt.sources" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$work/lists")
apt-get "${apt_opts[@]}" update -qq
apt-get "${apt_opts[@]}" source --download-only -qq "mpich=$MPICH_DEBIAN"
echo "$MPICH_SHA256  mpich_$MPICH_VERSION.orig.tar.xz" | sha256sum -c -
tar xf "mpich_$MPICH_VERSION.orig.tar.xz"
cd "mpich-$MPICH_VERSION"

# -- CUDA 13: computeMode left cudaDeviceProp ------------------------------------------------
hooks=modules/yaksa/src/backend/cuda/hooks/yaksuri_cuda_init_hooks.c
perl -0pi -e 's/struct cudaDeviceProp prop;\s*cerr = cudaGetDeviceProperties\(&prop, i\);/int mode;\n            cerr = cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, i);/; s/prop\.computeMode/mode/' "$hooks"
grep -q cudaDevAttrComputeMode "$hooks" || { echo "the computeMode patch did not apply to $hooks" >&2; exit 1; }

# -- yaksa's generated pack kernels: two levels of type nesting, not three -----------------------
# yaksa ships pack/unpack code for every builtin type under up to 3 levels of derived types: 104 MB
# of C (seq) and 39 MB of CUDA, ~40 s an nvcc compile. Its own generators (what its autogen.sh
# runs with --pup-max-nesting) make 17 MB and 7 MB at PUP_NESTING=2, the same files (the Makefile
# fragments must come out the same: no automake is needed, or run). A type nested deeper is still
# packed right, slower: yaksa's frontend splits it into its children when the backend answers
# YAKSA_ERR__NOT_SUPPORTED (yaksi_ipack_backend). Builtin types, what mpidp reduces, nest nothing.
nesting=${PUP_NESTING:-2}
mkdir -p "$work/mk"
for backend in seq cuda; do
    pup=modules/yaksa/src/backend/$backend/pup
    cp -p "$pup"/*.mk "$work/mk/"
    (cd modules/yaksa && "$python" "src/backend/$backend/genpup.py" --pup-max-nesting="$nesting")
    for mk in "$work"/mk/*.mk; do
        cmp -s "$mk" "$pup/${mk##*/}" || { echo "yaksa's $backend genpup.py changed ${mk##*/}" >&2; exit 1; }
        cp -p "$mk" "$pup/"  # with the tarball's time, so that make does not call automake
    done
    rm "$work"/mk/*.mk
done
# yaksa's nvcc wrapper compiles each file twice (PIC and not); this build is shared-only, so the
# second object is a copy of the first. It also names the libtool of PATH: its own is ./libtool.
cudalt=modules/yaksa/src/backend/cuda/cudalt.sh
perl -0pi -e 's/CMD="\$\{@\} -o \$NPIC_FILEPATH"/CMD="cp \$PIC_FILEPATH \$NPIC_FILEPATH"/; s/\$\(libtool --version/\$(.\/libtool --version/' "$cudalt"
grep -q 'CMD="cp ' "$cudalt" || { echo "the one-compile patch did not apply to $cudalt" >&2; exit 1; }

# -- libcuda.so.1, for linking only ---------------------------------------------------------------
# MPICH calls the driver API (cuMemFree, cuPointerGetAttributes, ...) and libfabric's configure
# links -lcuda, but the driver is not part of CUDA's toolkit (and this machine may have no GPU):
# a stand-in exporting every cu* function cuda.h declares, each returning CUDA_ERROR_STUB_LIBRARY,
# with the driver's SONAME, so a GPU machine loads its own driver. Kept in PREFIX/lib/stubs for
# loading the library where no driver exists (a CPU check); never put it on a GPU machine's path.
mkdir -p "$prefix/lib/stubs"
echo '#include <cuda.h>' | gcc -E -I"$cuda/include" -x c - | tr '\n' ' ' \
    | grep -oE 'CUresult +cu[A-Za-z0-9_]+ *\(' | grep -oE 'cu[A-Za-z0-9_]+' | sort -u \
    | sed 's/.*/int &(void) { return 34; }/' > libcuda_stub.c
gcc -shared -fPIC -o "$prefix/lib/stubs/libcuda.so.1" -Wl,-soname,libcuda.so.1 libcuda_stub.c
ln -s libcuda.so.1 "$prefix/lib/stubs/libcuda.so"
# the CUDA runtime goes with the library (a GPU machine's torch keeps its own out of the path)
cp -L "$cuda"/lib64/libcudart.so.[0-9]* "$prefix/lib/"

# -- MPICH ------------------------------------------------------------------------------------
log() {  # log NAME COMMAND...: the command's output in $work/NAME.log, its tail on failure
    local name=$1; shift
    "$@" > "$work/$name.log" 2>&1 || { tail -40 "$work/$name.log"; exit 1; }
    echo "$name done at $(( $(date +%s) - start )) s"
}
log configure env LDFLAGS="-L$prefix/lib/stubs" ./configure --prefix="$prefix" --with-device=ch4:ofi --with-libfabric=embedded \
    --with-hwloc=embedded --with-cuda="$cuda" --with-cuda-sm="$sm" --with-pm=hydra \
    --enable-fortran=no --disable-cxx --disable-doc --disable-static --enable-fast=O2
log make make -j"$jobs"
log install make install
rm -rf "$prefix/share" "$prefix"/lib/*.la "$prefix"/lib/pkgconfig
find "$prefix/lib" "$prefix/bin" -type f -exec sh -c 'file "$1" | grep -q ELF && strip --strip-unneeded "$1"' _ {} \;

# -- mpi4py against it ------------------------------------------------------------------------
cd "$work"
echo "mpi4py==$MPI4PY_VERSION --hash=sha256:$MPI4PY_SHA256" > mpi4py.txt
# the link tests of mpi4py's configuration resolve libmpi's libcuda.so.1 through the stub;
# --no-cache-dir: pip would hand back a wheel it built before against another MPI
log mpi4py env MPICC="$prefix/bin/mpicc" MPI4PY_BUILD_PYSABI=1 \
    LDFLAGS="-Wl,-rpath-link,$prefix/lib/stubs" "$python" -m pip wheel --no-deps --no-cache-dir \
    --no-binary mpi4py --require-hashes -r mpi4py.txt -w "$prefix/wheels"

# mpichversion links libmpi, hence libcuda.so.1: the stub where no driver is installed
version=$(LD_LIBRARY_PATH="$prefix/lib:$prefix/lib/stubs" "$prefix/bin/mpichversion")
echo "$version" | grep -E 'Version|Device|configure'
echo "$version" | grep -q -- "--with-cuda=" || { echo "mpichversion names no --with-cuda" >&2; exit 1; }
cd / && rm -rf "$work"
echo "built: $prefix ($(du -sh "$prefix" | cut -f1)) in $(( $(date +%s) - start )) s"
PYTHON=$python bash "$here/check_cuda_mpi.sh" "$prefix"  # all but the CUDA part, without a GPU
