#!/usr/bin/env bash
# A throw-away PostgreSQL server for the TPC-W baseline (tpcw::postgres).
#
# Usage: scripts/postgres.sh install            install PostgreSQL (Debian) if missing
#        scripts/postgres.sh start DIR [PORT]   init DIR if needed, start, print the
#                                               connection string on stdout
#        scripts/postgres.sh stop DIR           stop the server of DIR (if running)
#        scripts/postgres.sh status DIR         exit 0 and print the connection string
#                                               if it runs, exit 3 if it does not
#        scripts/postgres.sh watch DIR PID [--remove]
#                                               wait until process PID exits, then stop
#                                               the server (and delete DIR with --remove)
#
# Layout of DIR: data/ (the cluster), server.log, port (the port of the last start) and
# the server's Unix socket; namdb, which has this script built in, writes its copy there
# too (postgres.sh) and runs that. The server listens on 127.0.0.1:PORT (default: a free port,
# or the one it had last time), trusts every local connection, and has the superuser
# `namdb` and the database `tpcw`: the connection string is
#     host=127.0.0.1 port=PORT user=namdb dbname=tpcw
# Every command is idempotent: start on a running server prints its connection string,
# stop on a stopped (or absent) one does nothing.
#
# PostgreSQL refuses to run as root: as root, the server runs as the `postgres` system
# user (which the Debian package creates) and DIR is made its own.
#
# Configuration, for a fair comparison with namdb, which keeps its data in memory and
# is not yet durable (so neither side pays for durability):
#     fsync = off, synchronous_commit = off, full_page_writes = off
#         (commits do not wait for the disk; the data survives no crash);
#     shared_buffers = $POSTGRES_SHARED_BUFFERS (default 2GB): the whole database
#         stays in PostgreSQL's own cache;
#     max_connections = 300: one connection per runner client.
# Everything else is PostgreSQL's default.
set -euo pipefail

say() { printf '[postgres] %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

user=namdb
database=tpcw
shared_buffers=${POSTGRES_SHARED_BUFFERS:-2GB}

# The directory of initdb, pg_ctl and postgres: the newest Debian cluster version, else
# whatever is on PATH.
find_bindir() {
    local dir
    for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        [[ -x $dir/initdb && -x $dir/pg_ctl ]] && { echo "$dir"; return 0; }
    done
    if command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then
        dirname "$(command -v pg_ctl)"
        return 0
    fi
    return 1
}

have_postgres() { find_bindir >/dev/null; }

install() {
    if bindir=$(find_bindir); then
        return 0
    fi
    # Read only now, so a copy of this script run elsewhere needs it only to install.
    # shellcheck source=apt-install.sh
    source "$(dirname "$0")/apt-install.sh" || die "apt-install.sh is missing beside $0"
    apt_install PostgreSQL have_postgres postgresql
    bindir=$(find_bindir) || die "installed postgresql but found no initdb/pg_ctl"
}

# Runs a command as the user the server runs as.
as_server() {
    if [[ $(id -u) == 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

set_dir() {
    [[ -n ${1:-} ]] || usage
    mkdir -p "$1" || die "cannot create $1"
    dir=$(cd "$1" && pwd)
    data=$dir/data
    log=$dir/server.log
}

log_tail() {
    if [[ -f $log ]]; then
        say "last lines of $log:"
        tail -n 20 "$log" >&2
    fi
}

running() { [[ -f $data/PG_VERSION ]] && as_server "$bindir/pg_ctl" status -D "$data" >/dev/null 2>&1; }

conn_str() { echo "host=127.0.0.1 port=$(cat "$dir/port") user=$user dbname=$database"; }

# A port nobody listens on (bash's /dev/tcp connect fails); the server may still lose a
# race for it, and start then tries another.
free_port() {
    local port
    for _ in $(seq 50); do
        port=$((20000 + RANDOM % 40000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    die "found no free port"
}

init_cluster() {
    [[ -f $data/PG_VERSION ]] && return 0
    if [[ $(id -u) == 0 ]]; then
        id postgres >/dev/null 2>&1 || die "there is no postgres user to run the server as"
        chown postgres: "$dir"
        as_server test -w "$dir" ||
            die "the postgres user cannot write $dir (is a parent directory closed to it?); use a directory under /tmp"
    fi
    rm -rf "$data"
    say "initdb $data"
    as_server "$bindir/initdb" -D "$data" --username="$user" --auth=trust --encoding=UTF8 \
        --locale=C --no-sync >"$dir/initdb.log" 2>&1 ||
        { cat "$dir/initdb.log" >&2; die "initdb $data"; }
    cat >>"$data/postgresql.conf" <<EOF

# scripts/postgres.sh: in memory, not durable, like namdb (see the script's header).
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = $shared_buffers
max_connections = 300
EOF
}

start() {
    set_dir "${1:-}"
    local wanted=${2:-}
    install
    if running; then
        conn_str
        return 0
    fi
    init_cluster
    local attempts=1 port
    [[ -z $wanted && -f $dir/port ]] && attempts=2
    [[ -z $wanted ]] && attempts=$((attempts + 3))
    for ((i = 0; i < attempts; i++)); do
        if [[ -n $wanted ]]; then
            port=$wanted
        elif ((i == 0)) && [[ -f $dir/port ]]; then
            port=$(cat "$dir/port")
        else
            port=$(free_port)
        fi
        echo "$port" >"$dir/port"
        say "starting on 127.0.0.1:$port (log $log)"
        local log_lines=0
        [[ -f $log ]] && log_lines=$(wc -l <"$log")
        if as_server "$bindir/pg_ctl" start -D "$data" -l "$log" -w -t 60 \
            -o "-p $port" >/dev/null 2>&1; then
            break
        fi
        if ((i + 1 == attempts)) ||
            ! tail -n "+$((log_lines + 1))" "$log" 2>/dev/null | grep -q 'could not bind'; then
            log_tail
            die "the server in $data did not start"
        fi
        say "port $port is taken, trying another"
    done
    # pg_ctl -w returns once the server accepts connections; check that it does on TCP.
    as_server "$bindir/pg_isready" -q -h 127.0.0.1 -p "$port" -t 30 ||
        { log_tail; die "the server does not accept connections on 127.0.0.1:$port"; }
    local psql=("$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" -U "$user")
    if [[ -z $(as_server "${psql[@]}" -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$database'") ]]; then
        as_server "${psql[@]}" -d postgres -c "CREATE DATABASE $database" ||
            { log_tail; die "cannot create the database $database"; }
    fi
    conn_str
}

stop() {
    [[ -n ${1:-} ]] || usage
    [[ -d $1 ]] || return 0
    set_dir "$1"
    bindir=$(find_bindir) || return 0
    running || return 0
    as_server "$bindir/pg_ctl" stop -D "$data" -m fast -w -t 60 >/dev/null 2>&1 ||
        { log_tail; die "the server in $data did not stop"; }
    say "stopped the server in $data"
}

status() {
    [[ -n ${1:-} ]] || usage
    [[ -d $1 ]] || { say "no server directory $1"; exit 3; }
    set_dir "$1"
    bindir=$(find_bindir) || { say "PostgreSQL is not installed"; exit 3; }
    if running; then
        conn_str
    else
        say "no server runs in $data"
        exit 3
    fi
}

watch() {
    local target=${1:-} pid=${2:-} remove=${3:-}
    [[ -n $target && $pid =~ ^[0-9]+$ ]] || usage
    [[ -z $remove || $remove == --remove ]] || usage
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
    done
    stop "$target"
    if [[ -n $remove ]]; then
        rm -rf "$target"
    fi
}

command=${1:-}
shift || true
case $command in
    install) install ;;
    start) start "$@" ;;
    stop) stop "$@" ;;
    status) status "$@" ;;
    watch) watch "$@" ;;
    *) usage ;;
esac
