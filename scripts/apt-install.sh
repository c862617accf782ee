# Sourced by scripts/mpi.sh and scripts/postgres.sh when what they need is missing
# (they define `say` and `die`); namdb writes it beside them when it runs them.
#
# apt_install NAME CHECK PACKAGE…
#     Installs the Debian PACKAGEs with apt-get unless the command CHECK succeeds, one
#     install at a time on this host: tests and benchmarks started together on a machine
#     without NAME each installed it, and every apt-get but the first failed at once on
#     dpkg's lock. Each takes a lock ($NAMDB_INSTALL_LOCK, default
#     /var/cache/apt/namdb-install.lock, root's), waits for it saying why, and runs
#     CHECK again before installing; apt-get itself waits up to 10 minutes for dpkg's
#     lock held by anything else (unattended upgrades). Needs root.

apt_install() {
    local name=$1 check=$2
    shift 2
    "$check" && return 0
    [[ $(id -u) == 0 ]] || die "$name is missing and installing it needs root"
    local lock=${NAMDB_INSTALL_LOCK:-/var/cache/apt/namdb-install.lock} fd=
    if command -v flock >/dev/null && [[ -d $(dirname "$lock") ]]; then
        # Opened without truncating; the directory is root's, so no one else's link.
        exec {fd}<>"$lock" || die "cannot open $lock"
        if ! flock -n "$fd"; then
            say "waiting for another install of namdb's to finish ($lock)"
            flock "$fd" || die "cannot lock $lock"
        fi
        if "$check"; then
            exec {fd}>&-
            return 0
        fi
    fi
    say "$name is not installed; installing it with apt-get"
    apt-get -o DPkg::Lock::Timeout=600 update -qq || die "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@" \
        >/dev/null || die "apt-get install $*"
    [[ -z $fd ]] || exec {fd}>&-
    "$check" || die "apt-get installed $* but $name is still missing"
}
