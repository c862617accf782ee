#!/usr/bin/env bash
# The OpenMPI baseline of `namdb bench shuffle` (scripts/mpi-shuffle.c).
#
# Usage: scripts/mpi.sh install        install OpenMPI (Debian: openmpi-bin,
#                                      libopenmpi-dev) if mpicc or mpirun is missing
#        scripts/mpi.sh check          exit 0 if mpicc and mpirun are on PATH, else 3
#        scripts/mpi.sh build          compile mpi-shuffle.c (mpicc -O2) into
#                                      $MPI_BUILD_DIR (default: target/mpi) if stale;
#                                      prints the binary's path
#        scripts/mpi.sh run NP ARGS…   build, then run it on NP ranks of this host:
#                                      mpirun -np NP --oversubscribe mpi-shuffle ARGS…
#                                      (ARGS: --tuples X [--pattern repartition|broadcast|
#                                      both] [--message-bytes B] [--seed S]); one JSON
#                                      line per pattern on stdout
#
# Ranks talk through shared memory (btl self,vader), the one transport a single host
# needs; as root, mpirun needs --allow-run-as-root (set through the environment here).
set -euo pipefail

say() { printf '[mpi] %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${MPI_BUILD_DIR:-$repo/target/mpi}

have_mpi() { command -v mpicc >/dev/null && command -v mpirun >/dev/null; }

install() {
    have_mpi && return 0
    say "OpenMPI is not installed; installing it with apt-get"
    [[ $(id -u) == 0 ]] || die "OpenMPI is missing and installing it needs root"
    apt-get update -qq || die "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        openmpi-bin libopenmpi-dev >/dev/null || die "apt-get install openmpi-bin libopenmpi-dev"
    have_mpi || die "installed OpenMPI but found no mpicc/mpirun"
}

build() {
    have_mpi || die "OpenMPI is not installed (mpicc, mpirun); run: scripts/mpi.sh install"
    mkdir -p "$build_dir"
    local src=$repo/scripts/mpi-shuffle.c bin=$build_dir/mpi-shuffle
    if [[ ! -x $bin || $src -nt $bin ]]; then
        mpicc -O2 -o "$bin.tmp" "$src" || die "mpicc $src"
        mv "$bin.tmp" "$bin"
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
    exec mpirun -np "$np" --oversubscribe --bind-to none "$bin" "$@"
}

case ${1:-} in
    install) install ;;
    check) have_mpi || exit 3 ;;
    build) build ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac
