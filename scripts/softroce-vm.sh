#!/usr/bin/env bash
# Runs the verbs backend's tests on Soft-RoCE (rdma_rxe) inside a QEMU guest.
#
# The host needs no RDMA support: the guest boots Debian's stock kernel, loads rdma_rxe,
# adds an rxe device on its loopback interface, and runs binaries built here on the host
# through a read-only 9p mount of the host's root (so libibverbs and its rxe provider
# come from the host's rdma-core packages). Results come back through a second,
# writable 9p share; the script fails unless the guest reports success.
#
# Usage: scripts/softroce-vm.sh            install packages if missing, build, run
#        SOFTROCE_SKIP_BUILD=1 scripts/…   reuse the binaries of the last build
#        SOFTROCE_SMOKE=1 scripts/…        only boot and check that the rxe device works
# Environment: SOFTROCE_TIMEOUT (seconds for the guest, default 600),
#              SOFTROCE_MEMORY (guest memory, default 4G), SOFTROCE_CPUS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

say() { printf '[softroce] %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }

# ----------------------------------------------------------------- packages
packages=(qemu-system-x86 busybox-static kmod rdma-core ibverbs-utils ibverbs-providers
    libibverbs-dev iproute2 cmake libclang-dev pkg-config)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    [[ $(id -u) == 0 ]] || die "packages ${missing[*]} are missing and we are not root"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ----------------------------------------------------------------- kernel
work=$repo/target/softroce
mkdir -p "$work"
kernel_pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[[ -n $kernel_pkg ]] || die "cannot tell which kernel linux-image-amd64 depends on"
kver=${kernel_pkg#linux-image-}
kroot=$work/kernel-$kver
if [[ ! -f $kroot/boot/vmlinuz-$kver ]]; then
    say "fetching $kernel_pkg"
    rm -rf "$kroot" "$work"/*.deb
    (cd "$work" && apt-get download -qq "$kernel_pkg" 2>/dev/null) || die "apt-get download $kernel_pkg"
    dpkg-deb -x "$work/${kernel_pkg}"_*.deb "$kroot"
    depmod -b "$kroot" "$kver"
    rm -f "$work"/*.deb
fi
moddir=$kroot/lib/modules/$kver

# ----------------------------------------------------------------- build (host)
# The guest runs release binaries: TCG emulation is slow enough without debug builds.
smoke=${SOFTROCE_SMOKE:-}
if [[ -z ${SOFTROCE_SKIP_BUILD:-} && -z $smoke ]]; then
    say "building release binaries with --features verbs ($SECONDS s in)"
    cargo build --release -p namdb --features verbs
    cargo test --release -p fabric -p namdb --features verbs --no-run \
        --test conformance_verbs --test conformance_process_verbs 2>&1 | tee "$work/build.log" >&2
fi
test_binary() {
    # The newest executable of a test target in target/release/deps.
    { ls -t "$repo"/target/release/deps/"$1"-* 2>/dev/null || true; } | grep -v "\.d$" | head -n1 || true
}
fabric_suite=$(test_binary conformance_verbs)
process_suite=$(test_binary conformance_process_verbs)
namdb=$repo/target/release/namdb
if [[ -z $smoke ]]; then
    for b in "$fabric_suite" "$process_suite" "$namdb"; do
        [[ -x $b ]] || die "missing binary ${b:-(conformance test)}; build first"
    done
fi

# ----------------------------------------------------------------- initramfs
out=$(mktemp -d "${TMPDIR:-/tmp}/namdb-softroce.XXXXXX")
trap 'rm -rf "$out"' EXIT
chmod 777 "$out"
initrd=$work/initrd
rm -rf "$initrd" && mkdir -p "$initrd"/{bin,proc,sys,dev,newroot,modules}
cp /bin/busybox "$initrd/bin/busybox"

# Modules in load order, each after its dependencies (modules.dep). crc32_generic must
# precede rdma_rxe: rxe computes its ICRC with crc32 and fails to load without it.
wanted=(virtio_pci 9pnet_virtio 9p crc32_generic ib_uverbs rdma_rxe)
declare -A loaded=()
order=()
add_module() {
    local name=$1 path dep
    path=$(grep -E "(^|/)$name\.ko:" "$moddir/modules.dep" | head -n1 | cut -d: -f1 || true)
    if [[ -z $path ]]; then
        grep -q "/$name.ko\$" "$moddir/modules.builtin" || die "module $name is in neither modules.dep nor modules.builtin"
        return
    fi
    [[ -n ${loaded[$path]:-} ]] && return
    for dep in $(awk -F: -v p="$path" '$1 == p {print $2}' "$moddir/modules.dep"); do
        add_module "$(basename "$dep" .ko)"
    done
    loaded[$path]=1
    order+=("$path")
}
for m in "${wanted[@]}"; do add_module "$m"; done
for path in "${order[@]}"; do
    cp "$moddir/$path" "$initrd/modules/"
    basename "$path" >>"$initrd/modules/order"
done

cat >"$initrd/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules/order); do
    insmod /modules/$m || echo "softroce-guest: insmod $m failed"
done
out=$(sed -n 's/.*softroce.out=\([^ ]*\).*/\1/p' /proc/cmdline)
repo=$(sed -n 's/.*softroce.repo=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 hostroot /newroot ||
    { echo "softroce-guest: cannot mount the host root"; poweroff -f; }
# The guest's /tmp and /run are its own tmpfs; a checkout that lives under one of them
# (CI clones into /tmp) would vanish under it, so it is bound back in place.
mkdir -p /repo
mount -o bind /newroot$repo /repo
for d in tmp run; do mount -t tmpfs -o mode=1777 tmpfs /newroot/$d; done
if [ ! -d /newroot$repo/target ]; then
    mkdir -p /newroot$repo
    mount -o bind /repo /newroot$repo
fi
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/shm /newroot/dev/hugepages
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mkdir -p /newroot$out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results /newroot$out ||
    { echo "softroce-guest: cannot mount the results share"; poweroff -f; }
chroot /newroot /bin/bash $out/guest.sh >/newroot$out/guest.log 2>&1
echo "softroce-guest: guest.sh exited with $?"
sync
poweroff -f
EOF
chmod +x "$initrd/init"
(cd "$initrd" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$work/initrd.gz"

# ----------------------------------------------------------------- what the guest runs
cat >"$out/guest.sh" <<EOF
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp TMPDIR=/tmp RUST_BACKTRACE=1
status=0
step() { echo; echo "=== \$* ==="; }
fail() { echo "FAILED: \$*"; status=1; }
step "rxe device on lo"
ip link set lo up
rdma link add rxe0 type rxe netdev lo || fail "rdma link add"
rdma link show
ibv_devinfo -v | grep -E 'hca_id|state|active_mtu|GID' | head -n 12
ibv_devices | grep -q rxe0 || fail "libibverbs does not see rxe0"
if [[ -z "$smoke" ]]; then
step "conformance suite, verbs backend (fabric/tests/conformance_verbs.rs)"
NAMDB_VERBS_REQUIRED=1 timeout 600 $fabric_suite --test-threads 1 || fail "conformance_verbs"
step "conformance suite, memory server in another process (namdb/tests/conformance_process_verbs.rs)"
NAMDB_VERBS_REQUIRED=1 timeout 600 $process_suite --test-threads 1 || fail "conformance_process_verbs"
step "namdb bench fabric --backend verbs"
timeout 300 $namdb bench fabric --backend verbs --threads 1 --duration-ms 200 --json $out/bench.json || fail "bench fabric"
step "memory server and a benchmark client in two processes (ConnectQueuePair over gRPC)"
$namdb token generate /tmp/cluster.token
$namdb memory-server --listen 127.0.0.1:7700 --backend verbs --size 64MiB \
    --token-file /tmp/cluster.token >/tmp/memory-server.out 2>/tmp/memory-server.err &
server=\$!
for _ in \$(seq 120); do
    grep -q "listening" /tmp/memory-server.out && break
    sleep 0.5
done
cat /tmp/memory-server.out
timeout 300 $namdb bench fabric --backend verbs --connect 127.0.0.1:7700 \
    --token-file /tmp/cluster.token --threads 1 --duration-ms 200 --ops read,write,cas,fetch_add ||
    fail "bench fabric --connect"
kill -TERM \$server; wait \$server || fail "memory server exit"
tail -n 5 /tmp/memory-server.err
step "namdb bench shuffle --backend verbs (two node processes)"
timeout 300 $namdb bench shuffle --backend verbs --nodes 2 --threads 1 --tuples 100000 \
    --design MESQ/SR,MEMQ/WR --threading split,interleaved --baselines none \
    --json $out/shuffle.json || fail "bench shuffle"
fi
echo "softroce-status=\$status" >$out/status
exit \$status
EOF

# ----------------------------------------------------------------- boot
timeout_s=${SOFTROCE_TIMEOUT:-600}
say "booting $kver under TCG (timeout ${timeout_s}s; $SECONDS s in)"
set +e
timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -smp "${SOFTROCE_CPUS:-2}" -m "${SOFTROCE_MEMORY:-4G}" \
    -nic none -display none -no-reboot -serial "file:$out/console.log" \
    -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$work/initrd.gz" \
    -append "console=ttyS0 panic=-1 quiet rdinit=/init softroce.out=$out softroce.repo=$repo" \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$out,mount_tag=results,security_model=none"
qemu_status=$?
set -e
cp "$out/console.log" "$work/console.log" 2>/dev/null || true
cp "$out/guest.log" "$work/guest.log" 2>/dev/null || true
cp "$out/bench.json" "$work/bench.json" 2>/dev/null || true
if [[ -f $out/guest.log ]]; then cat "$out/guest.log"; else tail -n 40 "$out/console.log" >&2 || true; fi
((qemu_status == 0)) || die "qemu exited with $qemu_status (124: timed out after ${timeout_s}s); console in $work/console.log"
grep -qx 'softroce-status=0' "$out/status" 2>/dev/null ||
    die "the guest did not report success; logs in $work/{guest,console}.log"
say "all passed inside the guest in $SECONDS s; logs in $work"
