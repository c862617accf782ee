#!/usr/bin/env bash
# The DuckDB peer of the analytics benchmarks (`namdb bench join`, `namdb bench
# aggregate`): DuckDB from PyPI in a virtual environment, running scripts/duckdb_peer.py.
#
# Usage: scripts/duckdb.sh install      make the venv ($NAMDB_DUCKDB_VENV, default
#                                       duckdb-venv in namdb's cache directory) and
#                                       pip-install duckdb and numpy into it, unless it
#                                       has them already
#        scripts/duckdb.sh check        exit 0 if the venv can import duckdb, else 3
#        scripts/duckdb.sh run ARGS…    install if needed, then run duckdb_peer.py ARGS…
#                                       (see `scripts/duckdb.sh run --help`)
#
# namdb's cache directory: $NAMDB_CACHE_DIR, else $XDG_CACHE_HOME/namdb, else
# ~/.cache/namdb. namdb has this script built in and writes it, with duckdb_peer.py
# beside it, into each run's directory, so it finds the same venv from anywhere.
set -euo pipefail

say() { printf '[duckdb] %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
if [[ -n ${NAMDB_DUCKDB_VENV:-} ]]; then
    venv=$NAMDB_DUCKDB_VENV
elif [[ -n ${NAMDB_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-}}} ]]; then
    venv=${NAMDB_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/namdb}/duckdb-venv
else
    die "no cache directory for the venv: set NAMDB_DUCKDB_VENV, NAMDB_CACHE_DIR or HOME"
fi

have_duckdb() { [[ -x $venv/bin/python ]] && "$venv/bin/python" -c 'import duckdb, numpy' 2>/dev/null; }

install() {
    have_duckdb && return 0
    command -v python3 >/dev/null || die "python3 is not installed"
    mkdir -p "$(dirname "$venv")" || die "mkdir -p $(dirname "$venv")"
    # Runs started together on a machine without the venv (the tests do) would make
    # it together, and one `python3 -m venv` fails on the other's half-made tree: one
    # makes it while the others wait, then find it made.
    if command -v flock >/dev/null; then
        exec {venv_lock}>"$venv.lock" || die "cannot open $venv.lock"
        if ! flock -n "$venv_lock"; then
            say "waiting for another run making $venv"
            flock "$venv_lock" || die "cannot lock $venv.lock"
        fi
        if have_duckdb; then
            exec {venv_lock}>&-
            return 0
        fi
    fi
    say "installing duckdb and numpy from PyPI into $venv"
    python3 -m venv "$venv" || die "python3 -m venv $venv (Debian: apt-get install python3-venv)"
    "$venv/bin/pip" install -q --disable-pip-version-check duckdb numpy >&2 ||
        die "pip install duckdb numpy"
    have_duckdb || die "installed duckdb but cannot import it"
    # Not held by the peer this script becomes (`run` execs it) for a whole query.
    [[ -z ${venv_lock:-} ]] || exec {venv_lock}>&-
}

case ${1:-} in
    install) install ;;
    check) have_duckdb || exit 3 ;;
    run) shift; install; exec "$venv/bin/python" "$here/duckdb_peer.py" "$@" ;;
    *) usage ;;
esac
