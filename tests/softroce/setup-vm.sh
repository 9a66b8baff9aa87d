#!/bin/bash
# Build a small Debian 12 (bookworm) VM image that can run RDMA verbs over
# soft-RoCE (rdma_rxe), entirely from Debian packages.
#
#   setup-vm.sh            # build (idempotent: skips steps already done)
#   setup-vm.sh --force    # rebuild everything
#
# Artifacts go to $SOFTROCE_DIR (default /var/tmp/kvstore-softroce):
#   kernel/vmlinuz       Debian's stock kernel (linux-image-amd64)
#   kernel/initrd.gz     tiny busybox initramfs: loads virtio/ext4 modules, mounts /dev/vda
#   rootfs/              debootstrap --variant=minbase + rdma-core, ibverbs-providers,
#                        ibverbs-utils, perftest, rdmacm-utils, iproute2, kmod
#   root.img             ext4 image of rootfs/ (booted with snapshot=on: never modified)
# Needs root (debootstrap, chroot). Needs only Debian's package mirror.
set -euo pipefail

SR=${SOFTROCE_DIR:-/var/tmp/kvstore-softroce}
SUITE=bookworm
# The mirror: DEBIAN_MIRROR, else the first Debian URI of this host's own apt sources.
MIRROR=${DEBIAN_MIRROR:-$( (cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null || true) | grep -oE '^(URIs:|deb) +[^ ]+/debian/?( |$)' | awk '{print $2}' | head -n 1 || true)}
[ -n "$MIRROR" ] || { echo "[softroce setup] no Debian mirror found in /etc/apt: set DEBIAN_MIRROR" >&2; exit 1; }
HERE=$(cd "$(dirname "$0")" && pwd)
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

log() { echo "[softroce setup] $*" >&2; }

mkdir -p "$SR"
if [ $FORCE = 1 ]; then
    log "--force: removing old artifacts"
    rm -rf "$SR/rootfs" "$SR/kernel" "$SR/kpkg" "$SR/debs" "$SR/initrd" "$SR/root.img" "$SR"/*.stamp
fi

# 1. host packages ---------------------------------------------------------
need_pkgs="qemu-system-x86 debootstrap busybox-static cpio kmod e2fsprogs libibverbs-dev"
missing=""
for p in $need_pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
    log "apt-get install:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# 2. Debian's stock kernel (linux-image-amd64 -> linux-image-6.1.0-NN-amd64) --
if [ ! -f "$SR/kernel.stamp" ]; then
    kpkgname=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$kpkgname" ] || { log "cannot resolve linux-image-amd64 (run apt-get update)"; exit 1; }
    log "downloading $kpkgname"
    rm -rf "$SR/debs" "$SR/kpkg" "$SR/kernel"; mkdir -p "$SR/debs" "$SR/kernel"
    (cd "$SR/debs" && apt-get download "$kpkgname" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
    dpkg-deb -x "$SR"/debs/"$kpkgname"_*.deb "$SR/kpkg"
    kver=$(ls "$SR/kpkg/lib/modules")
    depmod -b "$SR/kpkg" "$kver"
    cp "$SR/kpkg/boot/vmlinuz-$kver" "$SR/kernel/vmlinuz"
    # Also extract the uncompressed ELF vmlinux: qemu boots it directly through the
    # PVH entry point (CONFIG_PVH=y), which skips SeaBIOS's linuxboot and the
    # in-guest XZ decompression: ~2.7 s faster per boot under TCG.
    python3 - "$SR/kernel/vmlinuz" "$SR/kernel/vmlinux" <<'PY' || rm -f "$SR/kernel/vmlinux"
import lzma, sys
d = open(sys.argv[1], 'rb').read()
i = d.find(b'\xfd7zXZ\x00')
if i < 0:
    sys.exit("vmlinuz payload is not XZ; using vmlinuz")
out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(d[i:])
if out[:4] != b'\x7fELF':
    sys.exit("payload is not ELF; using vmlinuz")
open(sys.argv[2], 'wb').write(out)
PY
    echo "$kver" > "$SR/kernel/version"
    touch "$SR/kernel.stamp"
fi
kver=$(cat "$SR/kernel/version")
log "kernel $kver"

# 3. root filesystem -------------------------------------------------------
if [ ! -f "$SR/rootfs.stamp" ]; then
    log "debootstrap $SUITE (minbase + rdma packages)"
    rm -rf "$SR/rootfs"
    debootstrap --variant=minbase \
        --include=rdma-core,ibverbs-providers,ibverbs-utils,perftest,rdmacm-utils,iproute2,kmod,procps,iputils-ping,busybox-static \
        "$SUITE" "$SR/rootfs" "$MIRROR" > "$SR/debootstrap.log" 2>&1 \
        || { tail -20 "$SR/debootstrap.log"; exit 1; }
    # trim what a test VM never needs
    rm -rf "$SR/rootfs/usr/share/doc" "$SR/rootfs/usr/share/man" "$SR/rootfs/usr/share/locale" \
           "$SR/rootfs/var/cache/apt/archives"/*.deb "$SR/rootfs/var/lib/apt/lists"/*
    echo softroce-vm > "$SR/rootfs/etc/hostname"
    touch "$SR/rootfs.stamp"
fi

# kernel modules (the whole tree, so modprobe of anything works in the VM); redone
# when the kernel package version changed
if [ ! -f "$SR/rootfs/lib/modules/$kver/modules.dep" ]; then
    log "installing modules $kver into rootfs"
    rm -rf "$SR/rootfs/lib/modules"; mkdir -p "$SR/rootfs/lib/modules"
    cp -a "$SR/kpkg/lib/modules/$kver" "$SR/rootfs/lib/modules/"
    depmod -b "$SR/rootfs" "$kver"
    touch "$SR/rootfs.stamp"
fi

# the in-VM init is refreshed on every setup run (cheap), then the image is rebuilt
install -m 0755 "$HERE/vm-init.sh" "$SR/rootfs/sbin/vm-init"

# 4. ext4 image of the rootfs (mke2fs -d: no loop mount needed) -------------
if [ ! -f "$SR/root.img" ] || [ "$HERE/vm-init.sh" -nt "$SR/root.img" ] || [ "$SR/rootfs.stamp" -nt "$SR/root.img" ]; then
    log "building root.img"
    rm -f "$SR/root.img.tmp"
    mke2fs -q -t ext4 -L vmroot -E root_owner=0:0 -d "$SR/rootfs" "$SR/root.img.tmp" 1536M
    mv "$SR/root.img.tmp" "$SR/root.img"
fi

# 5. initramfs: busybox + the modules needed to mount the root disk ----------
if [ ! -f "$SR/kernel/initrd.gz" ] || [ "$HERE/setup-vm.sh" -nt "$SR/kernel/initrd.gz" ]; then
    log "building initramfs"
    ird="$SR/initrd"; rm -rf "$ird"; mkdir -p "$ird"/{bin,dev,proc,sys,newroot,lib/modules}
    cp /bin/busybox "$ird/bin/busybox"
    for a in sh mount umount mkdir insmod switch_root sleep cat echo ls; do ln -s busybox "$ird/bin/$a"; done
    : > "$ird/modules.order"
    for m in virtio_pci virtio_blk ext4; do
        modprobe -d "$SR/kpkg" -S "$kver" --show-depends "$m" | awk '$1=="insmod"{print $2}'
    done | awk '!seen[$0]++' | while read -r ko; do
        cp "$ko" "$ird/lib/modules/"
        basename "$ko" >> "$ird/modules.order"
    done
    cat > "$ird/init" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do insmod /lib/modules/$m 2>/dev/null; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done
if ! mount -t ext4 -o rw,noatime /dev/vda /newroot; then
    echo "initramfs: cannot mount /dev/vda"; exec sh
fi
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /sbin/vm-init
EOF
    chmod +x "$ird/init"
    (cd "$ird" && find . | cpio -o -H newc --quiet | gzip -1 > "$SR/kernel/initrd.gz.tmp")
    mv "$SR/kernel/initrd.gz.tmp" "$SR/kernel/initrd.gz"
fi

log "ready: $(ls "$SR"/kernel/vmlinu[xz] | tr '\n' ' ')$SR/kernel/initrd.gz $SR/root.img"
