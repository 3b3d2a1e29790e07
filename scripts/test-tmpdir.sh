#!/usr/bin/env bash
# Runs CMD with TMPDIR set to a new directory in memory, removed when CMD ends:
#   scripts/test-tmpdir.sh CMD [ARG]...
# The tests' mongod data directories are temporary ones, and a majority write waits for
# the journal's fsync: on a disk that stalls for seconds now and then, the short leases
# the tests hold would end while the server waits on it. On a tmpfs an fsync is free.
# TEST_TMPDIR names the tmpfs (default /dev/shm); where it is missing or not writable,
# or TEST_TMPDIR is empty, CMD runs with TMPDIR as it is.
set -euo pipefail

base=${TEST_TMPDIR-/dev/shm}
if [ -n "$base" ] && [ -d "$base" ] && [ -w "$base" ]; then
    dir=$(mktemp -d "$base/django-mongolock-tests.XXXXXX")
    trap 'rm -rf "$dir"' EXIT
    export TMPDIR=$dir
fi
"$@"
