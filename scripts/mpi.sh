#!/usr/bin/env bash
# The OpenMPI baseline of `namdb bench shuffle` (scripts/mpi-shuffle.c).
#
# Usage: scripts/mpi.sh install        install OpenMPI (Debian: openmpi-bin,
#                                      libopenmpi-dev) if mpicc or mpirun is missing
#        scripts/mpi.sh check          exit 0 if mpicc and mpirun are on PATH, else 3
#        scripts/mpi.sh build          compile mpi-shuffle.c (beside this script;
#                                      mpicc -O2) into $MPI_BUILD_DIR (default: mpi in
#                                      namdb's cache directory) unless the binary there
#                                      was built from the same source; prints its path
#        scripts/mpi.sh run NP ARGS…   build, then run it on NP ranks of this host:
#                                      mpirun -np NP --oversubscribe mpi-shuffle ARGS…
#                                      (ranks bound to cores with NAMDB_MPI_BIND=core)
#                                      (ARGS: --tuples X [--pattern repartition|broadcast|
#                                      both] [--message-bytes B] [--seed S]
#                                      [--progress-file FILE [--progress-ms P]]); one
#                                      JSON line per pattern on stdout, rank 0's
#                                      progress lines appended to FILE
#
# Ranks talk through shared memory (btl self,vader), the one transport a single host
# needs; as root, mpirun needs --allow-run-as-root (set through the environment here).
# namdb's cache directory: $NAMDB_CACHE_DIR, else $XDG_CACHE_HOME/namdb, else
# ~/.cache/namdb. namdb has this script built in and writes it, with mpi-shuffle.c
# beside it, into a directory of each run's.
set -euo pipefail

say() { printf '[mpi] %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
build_dir() {
    if [[ -n ${MPI_BUILD_DIR:-} ]]; then
        echo "$MPI_BUILD_DIR"
    elif [[ -n ${NAMDB_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-}}} ]]; then
        echo "${NAMDB_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/namdb}/mpi"
    else
        die "no directory to build in: set MPI_BUILD_DIR, NAMDB_CACHE_DIR or HOME"
    fi
}

have_mpi() { command -v mpicc >/dev/null && command -v mpirun >/dev/null; }

install() {
    have_mpi && return 0
    # shellcheck source=apt-install.sh
    source "$here/apt-install.sh" || die "apt-install.sh is missing beside $0"
    apt_install OpenMPI have_mpi --no-install-recommends openmpi-bin libopenmpi-dev
}

build() {
    have_mpi || die "OpenMPI is not installed (mpicc, mpirun); run: scripts/mpi.sh install"
    local dir
    dir=$(build_dir)
    mkdir -p "$dir" || die "mkdir -p $dir"
    local src=$here/mpi-shuffle.c bin=$dir/mpi-shuffle
    # The source is written out afresh for every run, so its age says nothing: the
    # copy kept beside the binary says what it was built from. Concurrent runs each
    # build into their own temporary names and rename, so none runs a half-written one.
    if [[ ! -x $bin ]] || ! cmp -s "$src" "$bin.c"; then
        mpicc -O2 -o "$bin.tmp.$$" "$src" || die "mpicc $src"
        cp "$src" "$bin.c.tmp.$$"
        mv "$bin.tmp.$$" "$bin"
        mv "$bin.c.tmp.$$" "$bin.c"
    fi
    echo "$bin"
}

run() {
    [[ $# -ge 1 && $1 =~ ^[1-9][0-9]*$ ]] || usage
    local np=$1
    shift
    local bin
    bin=$(build)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    # Quiet the warnings a container without an InfiniBand stack or hwloc topology
    # gives, and keep every byte on this host's shared memory.
    export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none \
        OMPI_MCA_pml=ob1 OMPI_MCA_osc=pt2pt OMPI_MCA_rmaps_base_oversubscribe=1
    # The ranks end with mpirun (mpi-shuffle.c, end_with_mpirun): exec keeps the pid.
    export NAMDB_MPIRUN_PID=$$
    # NAMDB_MPI_BIND=core binds each rank to a core (more ranks than cores share them).
    local bind=none
    case ${NAMDB_MPI_BIND:-none} in
        none) ;;
        core) bind=core:overload-allowed ;;
        *) die "NAMDB_MPI_BIND must be none or core, not ${NAMDB_MPI_BIND}" ;;
    esac
    exec mpirun -np "$np" --oversubscribe --bind-to "$bind" "$bin" "$@"
}

case ${1:-} in
    install) install ;;
    check) have_mpi || exit 3 ;;
    build) build ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac
