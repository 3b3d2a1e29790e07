#!/usr/bin/env bash
# Minimal Debian roots for the test matrix: a newer Python than the host's without Docker.
#
#   scripts/chroot.sh build SUITE DIR     make DIR a Debian SUITE root (trixie: Python 3.13,
#                                         forky: Python 3.14), or refresh an existing one
#   scripts/chroot.sh run DIR CMD [ARG]   run CMD inside DIR, with /proc, /dev and /sys mounted
#                                         for the command's lifetime only
#   scripts/chroot.sh remove DIR          unmount whatever is left mounted under DIR, then
#                                         delete DIR (never across a mount)
#
# Both are idempotent: a finished root carries a stamp naming its suite and package list, and
# is reused as it is; a half-built one (no stamp) is removed and built again. Needs root
# (debootstrap, chroot, mount); debootstrap itself is installed with apt-get when missing.
#
# Traps this script handles (docs/contributing.md says more):
# - an older host's debootstrap has no script for a newer suite: the `sid` script builds it;
# - a testing suite's Release file may read as expired: apt in the root ignores Valid-Until;
# - /dev and /sys are bound with --rbind and made rslave, so unmounting them in the root never
#   unmounts the host's own submounts (/dev/pts, /dev/shm, /sys/fs/cgroup, ...);
# - mounts are undone by a trap on every exit, and nothing under DIR is deleted while anything
#   is mounted there;
# - pip in the root gets the host's CA bundle and pip settings, less what names host paths
#   (find-links, file:// indexes), which mean nothing inside; constraint and requirement files
#   the settings name are copied in (pip refuses to start without them).
set -euo pipefail

# Packages of every root: Python with venv and headers, a compiler for sdists, git for the
# clone of the checkout, libcurl (the bundled mongod links it; Debian 13 renamed it
# libcurl4t64).
PACKAGES=python3,python3-venv,python3-dev,ca-certificates,git,make,build-essential,libcurl4t64
# Installed with apt inside the finished base, where /proc and /dev are mounted
# (debootstrap's --include leaves dconf, and so Chromium, unconfigured), and added to an
# existing root when this list grows: Chromium and a font for the admin's browser tests;
# PostgreSQL, MariaDB and what mysqlclient builds against for the fenced-write tests.
APT_PACKAGES="chromium fonts-dejavu-core postgresql mariadb-server libmariadb-dev pkg-config"
# Bump when the root's recipe changes: roots with another stamp are rebuilt.
RECIPE=1

die() { echo "chroot.sh: $*" >&2; exit 2; }
say() { printf '[chroot %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot, mount)"; }

# One user of a root at a time: a run's exit trap unmounts everything under the root, which
# would pull /proc from under another run. The lock file sits beside the root.
lock_root() {
    local root=$1
    exec 9>"$root.lock"
    if ! flock -n 9; then
        say "waiting for another user of $root"
        flock 9
    fi
}

# Every mount point at or below $1, deepest first (so they unmount in order).
mounts_under() {
    local dir=$1
    awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r
}

unmount_all() {
    local dir=$1 m
    for m in $(mounts_under "$dir"); do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
}

remove_root() {
    local dir=$1
    unmount_all "$dir"
    if [ -n "$(mounts_under "$dir")" ]; then
        die "refusing to remove $dir: still mounted: $(mounts_under "$dir" | tr '\n' ' ')"
    fi
    rm -rf --one-file-system "$dir"
}

# debootstrap's own default mirror, unless MATRIX_MIRROR says another one.
default_mirror() {
    if [ -n "${MATRIX_MIRROR:-}" ]; then
        echo "$MATRIX_MIRROR"
        return
    fi
    sed -n 's/^DEF_MIRROR="\(.*\)"$/\1/p' "$(command -v debootstrap)" | head -n1
}

# The host's pip settings for the root: every key of `pip config list` (files and PIP_*
# variables), less find-links and file:// indexes (host paths), with the CA bundle at the
# path it is copied to in the root. The files that constraint and requirement keys name are
# copied into the root at the same paths (a key whose files are all missing is left out).
write_pip_conf() {
    local root=$1 python
    python=$(command -v python3 || true)
    mkdir -p "$root/etc"
    {
        echo "[global]"
        echo "cert = /etc/ssl/certs/host-ca-certificates.crt"
        echo "disable-pip-version-check = true"
        if [ -n "$python" ] && "$python" -m pip --version >/dev/null 2>&1; then
            "$python" -m pip config list 2>/dev/null | "$python" -c '
import os
import shutil
import sys

root = sys.argv[1]
seen = set()
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    name = key.rsplit(".", 1)[-1]
    value = value.strip().strip("\x27\"")
    if name in {"cert", "find-links", "disable-pip-version-check", "no-index"} or name in seen:
        continue
    if name in {"index-url", "extra-index-url"}:
        value = " ".join(u for u in value.split() if not u.startswith("file:"))
        if not value:
            continue
    if name in {"constraint", "requirement", "build-constraint"}:
        paths = [path for path in value.split() if os.path.isfile(path)]
        for path in paths:
            target = root + os.path.abspath(path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)
        if not paths:
            continue
        value = " ".join(os.path.abspath(path) for path in paths)
    seen.add(name)
    print(f"{name} = {value}")
' "$root"
        fi
    } >"$root/etc/pip.conf"
}

configure_root() {
    local root=$1 ca
    # apt: a testing suite's Release file may be past its Valid-Until date.
    mkdir -p "$root/etc/apt/apt.conf.d"
    printf 'Acquire::Check-Valid-Until "false";\n' >"$root/etc/apt/apt.conf.d/99matrix"
    # The host's CA bundle (it may hold a proxy's or a site's own CA), beside the root's own.
    for ca in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
        if [ -n "$ca" ] && [ -f "$ca" ]; then
            mkdir -p "$root/etc/ssl/certs"
            cp -f "$ca" "$root/etc/ssl/certs/host-ca-certificates.crt"
            break
        fi
    done
    write_pip_conf "$root"
    # Packages never start their services in the root (postgresql, mariadb-server): a daemon
    # left running would hold the root's mounts. The tests start their own servers.
    mkdir -p "$root/usr/sbin"
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod 755 "$root/usr/sbin/policy-rc.d"
    cp -f /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}

# APT_PACKAGES that the root lacks, installed with apt-get (nothing to do on a current root).
install_apt_packages() {
    local root=$1 package missing=()
    for package in $APT_PACKAGES; do
        chroot "$root" dpkg-query -W -f='${Status}' "$package" 2>/dev/null \
            | grep -q 'ok installed' || missing+=("$package")
    done
    ((${#missing[@]})) || return 0
    say "apt-get install ${missing[*]} in $root"
    # A subshell: run_in's trap unmounts when it ends, before the stamp says the root is done.
    (
        run_in "$root" sh -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -q \
            && apt-get install -y -q --no-install-recommends "$@" && apt-get clean' sh "${missing[@]}"
    )
}

build() {
    local suite=$1 root=$2 stamp script=() mirror
    need_root
    [ -n "$suite" ] && [ -n "$root" ] || die "usage: $0 build SUITE DIR"
    mkdir -p "$(dirname "$root")"
    root=$(cd "$(dirname "$root")" && pwd)/$(basename "$root")
    stamp="suite=$suite recipe=$RECIPE packages=$PACKAGES"
    lock_root "$root"
    if [ -f "$root/.matrix-root" ] && [[ "$(cat "$root/.matrix-root")" == "$stamp"* ]]; then
        say "$suite root at $root is ready (cached)"
        configure_root "$root"
        install_apt_packages "$root"
        return
    fi
    if [ -e "$root" ]; then
        say "removing the unfinished or outdated root at $root"
        remove_root "$root"
    fi
    if ! command -v debootstrap >/dev/null 2>&1; then
        say "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
    fi
    mirror=$(default_mirror)
    [ -n "$mirror" ] || die "no mirror: set MATRIX_MIRROR"
    # A suite newer than this debootstrap knows: the `sid` script builds any testing suite.
    if [ ! -e "/usr/share/debootstrap/scripts/$suite" ]; then
        script=(/usr/share/debootstrap/scripts/sid)
    fi
    say "debootstrap $suite into $root (takes a few minutes)"
    debootstrap --variant=minbase --include="$PACKAGES" "$suite" "$root" "$mirror" "${script[@]}"
    configure_root "$root"
    install_apt_packages "$root"
    echo "$stamp" >"$root/.matrix-root"
    say "$suite root at $root is ready: $(chroot "$root" python3 --version)"
}

run() {
    local root=$1
    shift
    need_root
    [ -f "$root/.matrix-root" ] || die "$root is not a finished root: run '$0 build SUITE $root' first"
    root=$(cd "$root" && pwd)
    lock_root "$root"
    run_in "$root" "$@"
}

run_in() {
    local root=$1
    shift
    root=$(cd "$root" && pwd)
    # Mounted for this command only, and undone on every exit (error, signal, success).
    # shellcheck disable=SC2064
    trap "unmount_all '$root'" EXIT
    trap 'exit 130' INT TERM
    mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
    mountpoint -q "$root/dev" || { mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"; }
    mountpoint -q "$root/sys" || { mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"; }
    # A clean environment: nothing host-only (PIP_FIND_LINKS, PATH entries, VIRTUAL_ENV) leaks in.
    local env=(HOME=/root LANG=C.UTF-8 LC_ALL=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}"
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
        PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off)
    local var
    for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_DEFAULT_TIMEOUT; do
        [ -n "${!var:-}" ] && env+=("$var=${!var}")
    done
    # Set, even empty (the tests' temporary files on disk): scripts/test-tmpdir.sh.
    [ -n "${TEST_TMPDIR+set}" ] && env+=("TEST_TMPDIR=$TEST_TMPDIR")
    chroot "$root" /usr/bin/env -i "${env[@]}" "$@"
}

case "${1:-}" in
    build) shift; build "${1:-}" "${2:-}" ;;
    run) shift; [ $# -ge 2 ] || die "usage: $0 run DIR CMD [ARG...]"; run "$@" ;;
    remove)
        shift
        [ $# -eq 1 ] || die "usage: $0 remove DIR"
        need_root
        [ -e "$1" ] || exit 0
        dir=$(cd "$1" && pwd)
        lock_root "$dir"
        remove_root "$dir"
        rm -f "$dir.lock"
        ;;
    *) die "usage: $0 build SUITE DIR | run DIR CMD [ARG...] | remove DIR" ;;
esac
