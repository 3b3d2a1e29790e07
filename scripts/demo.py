"""``make demo``: the test project on a local MongoDB, with workers that keep its locks busy.

Without ``MONGOLOCK_URL`` it starts ``python -m django_mongolock.testing serve`` (a single-node
replica set with its data in ``.mongodb/demo``) and always stops it again, also on errors.
While the admin runs, the workers of ``testproject.demo_workers`` hand locks over, fill a
semaphore, elect a leader, crash while holding a lock, and lose one to an operator.

Every child runs in a process group of its own, so the terminal's Ctrl+C reaches this script
alone, which then stops them in order: workers (they give back their locks), the web server,
MongoDB. SIGTERM does the same.
"""

from __future__ import annotations

import argparse
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
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
DBPATH = ROOT / ".mongodb" / "demo"
CREATE_ADMIN = """
from django.contrib.auth import get_user_model
User = get_user_model()
if User.objects.filter(username="admin").exists():
    print("superuser admin exists")
else:
    User.objects.create_superuser("admin", "admin@example.com", "admin")
    print("superuser admin created")
"""
# name -> role of each long-running worker; the owner prefix the admin shows is the name.
WORKERS = {
    "handoff-1": "handoff",
    "handoff-2": "handoff",
    "handoff-3": "handoff",
    "exporter": "semaphore",
    "candidate-a": "candidate",
    "candidate-b": "candidate",
    "candidate-c": "candidate",
    "importer-1": "importer",
    "importer-2": "importer",
}
CRASH_EVERY = 90.0
"""Seconds between two holders that die by SIGKILL (the first one dies at the start)."""
STOP_WITHIN = 15.0
"""Seconds each group of children gets to stop after SIGTERM before it is killed."""

Process = subprocess.Popen[Any]


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


def spawn(command: list[str], **kwargs: Any) -> Process:
    """A child in a process group of its own: the terminal's Ctrl+C is ours to relay."""
    return subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, process_group=0, **kwargs)


def manage(*args: str, capture: bool = False, label: str = "") -> str:
    say(label or " ".join(["manage.py", *args]))
    stdout = subprocess.PIPE if capture else None
    with spawn([sys.executable, "manage.py", *args], stdout=stdout, text=True) as process:
        try:
            output, _ = process.communicate()
        except BaseException:
            stop([process])
            raise
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, ["manage.py", *args])
    return output if capture else ""


def start_mongodb(dbpath: Path, port: int | None) -> tuple[Process, str]:
    """Start ``serve`` and wait for the URL it prints; its later output goes to ours."""
    if not port:
        port = 27017 if port is None and port_is_free(27017) else free_port()
    command = [sys.executable, "-m", "django_mongolock.testing", "serve"]
    command += ["--dbpath", str(dbpath), "--port", str(port)]
    say(f"starting MongoDB: {' '.join(command[1:])}")
    process = spawn(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        url = read_url(process, process.stdout, timeout=90.0)
    except BaseException:
        stop([process])
        raise
    copier = threading.Thread(target=shutil.copyfileobj, args=(process.stdout, sys.stdout))
    copier.daemon = True
    copier.start()
    return process, url


def read_url(process: Process, stream: IO[str], timeout: float) -> str:
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


def stop(processes: list[Process], timeout: float = STOP_WITHIN) -> None:
    """SIGTERM to each process group, then SIGKILL to those still there after ``timeout``."""
    for process in processes:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"demo: pid {process.pid} did not stop; killing it", file=sys.stderr)
            signal_group(process, signal.SIGUSR1)  # a worker prints where it is stuck
            time.sleep(0.5)
            signal_group(process, signal.SIGKILL)
            process.wait()


def signal_group(process: Process, signum: int) -> None:
    """Signal the child's process group (it leads it), or the child alone once it is reaped."""
    try:
        if process.poll() is None:
            os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


class Workers:
    """The demo's worker processes, and the holder that is killed now and then."""

    def __init__(self, url: str, database: str, admin: str) -> None:
        self.common = ["--url", url, "--database", database]
        self.admin = admin
        self.running: list[Process] = []
        self.next_crash = 0.0

    def _start(self, role: str, name: str, *extra: str) -> Process:
        module = [sys.executable, "-m", "testproject.demo_workers", role, "--name", name]
        process = spawn([*module, *self.common, *extra])
        self.running.append(process)
        return process

    def start(self) -> None:
        for name, role in WORKERS.items():
            self._start(role, name)
        self._start("operator", "operator", "--admin", self.admin)
        self.tick()

    def tick(self) -> None:
        """Reap the crashed holder; start the next one when it is time."""
        self.running = [p for p in self.running if p.poll() is None or not self._is_crash(p)]
        if time.monotonic() >= self.next_crash:
            self.next_crash = time.monotonic() + CRASH_EVERY
            self._start("crash", "crash")

    @staticmethod
    def _is_crash(process: Process) -> bool:
        return isinstance(process.args, list) and "crash" in process.args

    def stop(self) -> None:
        stop(self.running)
        self.running.clear()


def serve(url: str, address: str) -> int:
    """Run the workers and the admin until the web server ends or we are told to stop."""
    workers = Workers(url, os.environ["MONGOLOCK_DATABASE"], f"http://{address}/admin/")
    server: Process | None = None
    try:
        say("starting the demo workers (testproject/demo_workers.py)")
        workers.start()
        say(f"admin at http://{address}/admin/ (user admin, password admin); Ctrl+C stops")
        say(f"locks: http://{address}/admin/django_mongolock/lock/?refresh=5")
        server = spawn([sys.executable, "manage.py", "runserver", address, "--noreload"])
        while server.poll() is None:
            workers.tick()
            time.sleep(0.5)
        return server.returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl+C must not cut the shutdown short; every stop is bounded.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("stopping the demo workers")
        workers.stop()
        if server is not None:
            stop([server])


def terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="the admin's port (8000)")
    parser.add_argument("--dbpath", type=Path, default=DBPATH, help=f"MongoDB data ({DBPATH})")
    parser.add_argument(
        "--mongo-port", type=int, help="MongoDB's port (default: 27017 if free; 0: any free one)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ.setdefault("MONGOLOCK_DATABASE", "mongolock_demo")
    # SIGTERM stops like Ctrl+C. A shell starts background jobs with SIGINT ignored: restore it.
    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mongodb: Process | None = None
    try:
        if os.environ.get("MONGOLOCK_URL"):
            say(f"using MONGOLOCK_URL={os.environ['MONGOLOCK_URL']}")
        else:
            mongodb, url = start_mongodb(args.dbpath, args.mongo_port)
            os.environ["MONGOLOCK_URL"] = url
            say(f"MONGOLOCK_URL={url}")
        manage("migrate", "--no-input")
        manage("migrate_mongolock")
        manage("shell", "-c", CREATE_ADMIN, label="manage.py shell -c <create superuser admin>")
        return serve(os.environ["MONGOLOCK_URL"], f"127.0.0.1:{args.port}")
    except subprocess.CalledProcessError as exc:
        print(f"demo: {' '.join(exc.cmd)} failed with code {exc.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if mongodb is not None:
            say("stopping MongoDB")
            stop([mongodb], timeout=30.0)
        say("demo stopped")


if __name__ == "__main__":
    sys.exit(main())
