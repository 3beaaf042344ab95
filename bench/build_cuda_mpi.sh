#!/usr/bin/env bash
# Build a CUDA-aware Open MPI from source, for a site whose MPI is not CUDA-aware.
#
#     bash bench/build_cuda_mpi.sh PREFIX [SOURCE_TARBALL]
#
# SOURCE_TARBALL: an Open MPI 4.1 release tarball (openmpi-4.1.*.tar.{gz,bz2,xz}); without one,
# Debian's source package of Open MPI is fetched with `apt-get source` (bookworm: 4.1.4).
# Needs a C compiler and CUDA's headers (CUDA_HOME, default /usr/local/cuda: only cuda.h is read;
# Open MPI 4.1 opens libcuda.so.1 at run time, so no GPU and no driver are needed to build).
# Fortran, OpenSHMEM, UCX, verbs and OFI are left out: this MPI is for one node's ranks (shared
# memory with CUDA IPC, TCP between nodes). A site with UCX/InfiniBand adds --with-ucx.
#
# Use it: PATH=PREFIX/bin:$PATH LD_LIBRARY_PATH=PREFIX/lib; mpi4py's wheel picks Open MPI's
# libmpi.so.40 when MPI4PY_LIBMPI=PREFIX/lib/libmpi.so (or when it is the one on the path).
# `python -m mpidp info` then reports "the MPI library reports CUDA support".
set -euo pipefail
prefix=$(realpath -m "${1:?usage: build_cuda_mpi.sh PREFIX [SOURCE_TARBALL]}")
tarball=${2:-}
cuda=${CUDA_HOME:-/usr/local/cuda}
[ -f "$cuda/include/cuda.h" ] || { echo "no $cuda/include/cuda.h: set CUDA_HOME" >&2; exit 1; }
work=$(mktemp -d /tmp/cuda-mpi-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
if [ -z "$tarball" ]; then
    src=$work/apt.sources
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$src"
    apt_opts=(-o Dir::Etc::sourcelist="$src" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$work/lists")
    mkdir -p "$work/lists/partial"
    apt-get "${apt_opts[@]}" update -qq
    apt-get "${apt_opts[@]}" source --download-only -qq openmpi
    tarball=$(ls "$work"/openmpi_*.orig.tar.*)
fi
tar xf "$tarball"
cd openmpi-*/
./configure --prefix="$prefix" --with-cuda="$cuda" \
    --disable-mpi-fortran --disable-oshmem --disable-man-pages --without-ucx --without-verbs \
    --without-ofi --without-psm2 --enable-mpi1-compatibility --disable-static \
    > "$work/configure.log" 2>&1 || { tail -40 "$work/configure.log"; exit 1; }
make -j"$(nproc)" > "$work/make.log" 2>&1 || { tail -40 "$work/make.log"; exit 1; }
make install > "$work/install.log" 2>&1 || { tail -40 "$work/install.log"; exit 1; }
rm -rf "$prefix/share/doc" "$prefix/share/man"
"$prefix/bin/ompi_info" --parsable --all | grep -E 'mpi_built_with_cuda_support:value'
echo "built: $prefix ($(du -sh "$prefix" | cut -f1))"
