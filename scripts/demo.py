"""``make demo``: the test project on a local MongoDB, with an admin user, until Ctrl+C.

Without ``MONGOLOCK_URL`` it starts ``python -m django_mongolock.testing serve`` (a single-node
replica set with its data in ``.mongodb/demo``) and always stops it again, also on errors.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
DBPATH = ROOT / ".mongodb" / "demo"
ADDRESS = "127.0.0.1:8000"
CREATE_ADMIN = """
from django.contrib.auth import get_user_model
User = get_user_model()
if User.objects.filter(username="admin").exists():
    print("superuser admin exists")
else:
    User.objects.create_superuser("admin", "admin@example.com", "admin")
    print("superuser admin created")
"""


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def port_is_free(port: int) -> bool:
    """Whether mongod could listen there (it sets SO_REUSEADDR, so TIME_WAIT is no obstacle)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def manage(*args: str, capture: bool = False, label: str = "") -> str:
    command = [sys.executable, "manage.py", *args]
    say(label or " ".join(["manage.py", *args]))
    result = subprocess.run(command, cwd=ROOT, check=True, text=True, capture_output=capture)
    return result.stdout if capture else ""


def start_mongodb() -> tuple[subprocess.Popen[str], str]:
    """Start ``serve`` and wait for the URL it prints; its later output goes to ours."""
    port = 27017 if port_is_free(27017) else free_port()
    command = [
        sys.executable,
        "-m",
        "django_mongolock.testing",
        "serve",
        "--dbpath",
        str(DBPATH),
        "--port",
        str(port),
    ]
    say(f"starting MongoDB: {' '.join(command[1:])}")
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        url = read_url(process, process.stdout, timeout=90.0)
    except BaseException:
        stop(process)
        raise
    copier = threading.Thread(target=shutil.copyfileobj, args=(process.stdout, sys.stdout))
    copier.daemon = True
    copier.start()
    return process, url


def read_url(process: subprocess.Popen[str], stream: IO[str], timeout: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                continue
            line = stream.readline()
            if not line:
                raise SystemExit(f"MongoDB did not start (exit code {process.wait()}); see above")
            if line.startswith("MONGOLOCK_URL="):
                return line.removeprefix("MONGOLOCK_URL=").strip()
            sys.stdout.write(line)
    raise SystemExit(f"MongoDB printed no URL within {timeout:g}s")


def stop(process: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    os.chdir(ROOT)
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    signal.signal(signal.SIGTERM, terminated)  # so that `finally` stops what was started
    # A shell starts background jobs with SIGINT ignored, and children would inherit that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mongodb: subprocess.Popen[str] | None = None
    server: subprocess.Popen[bytes] | None = None
    try:
        if os.environ.get("MONGOLOCK_URL"):
            say(f"using MONGOLOCK_URL={os.environ['MONGOLOCK_URL']}")
        else:
            mongodb, url = start_mongodb()
            os.environ["MONGOLOCK_URL"] = url
            say(f"MONGOLOCK_URL={url}")
        manage("migrate", "--no-input")
        manage("migrate_mongolock")
        manage("shell", "-c", CREATE_ADMIN, label="manage.py shell -c <create superuser admin>")
        commands = manage("help", "--commands", capture=True).split()
        if "report_gen" in commands:
            manage("report_gen", "--seconds", "3")
        say(f"admin at http://{ADDRESS}/admin/ (user admin, password admin); Ctrl+C stops")
        server = subprocess.Popen([sys.executable, "manage.py", "runserver", ADDRESS, "--noreload"])
        try:
            return server.wait()
        except KeyboardInterrupt:
            # The terminal sent SIGINT to runserver too; wait for it, then stop.
            server.send_signal(signal.SIGINT)
            server.wait()
            return 0
    except subprocess.CalledProcessError as exc:
        print(
            f"demo: {' '.join(map(str, exc.cmd))} failed with code {exc.returncode}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # Ctrl+C reached every child already; a second one must not leave MongoDB running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if server is not None:
            stop(server)
        if mongodb is not None:
            say("stopping MongoDB")
            stop(mongodb)


if __name__ == "__main__":
    sys.exit(main())
