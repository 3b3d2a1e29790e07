#!/usr/bin/env bash
# Runs CMD with TMPDIR set to a new directory in memory, removed when CMD has ended:
#   scripts/test-tmpdir.sh CMD [ARG]...
# The tests' mongod data directories are temporary ones, and a majority write waits for
# the journal's fsync: on a disk that stalls for seconds now and then, the short leases
# the tests hold would end while the server waits on it. On a tmpfs an fsync is free.
# TEST_TMPDIR names the tmpfs (default /dev/shm). Where it is missing, not writable or
# has less than 2 GiB free, or TEST_TMPDIR is empty, CMD runs with TMPDIR as it is.
# CMD's exit status is this script's, and the directory is removed once CMD has ended.
set -euo pipefail

base=${TEST_TMPDIR-/dev/shm}
free_kib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'; }
if [ -n "$base" ] && [ -d "$base" ] && [ -w "$base" ] \
    && [ "$(free_kib "$base" || echo 0)" -ge $((2 * 1024 * 1024)) ]; then
    dir=$(mktemp -d "$base/django-mongolock-tests.XXXXXX")
    # Like /tmp: the servers some tests run as another user (PostgreSQL's initdb refuses
    # root) make their own directories in it.
    chmod 1777 "$dir"
    export TMPDIR=$dir
else
    exec "$@"
fi

# A signal sent to this script alone must not end it before CMD: the directory would go
# while CMD still runs. A signal to the process group (Ctrl+C) reaches CMD too.
trap ':' INT TERM HUP
status=0
"$@" || status=$?
rm -rf "$dir" || true
exit "$status"
