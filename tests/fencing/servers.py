"""What the throwaway SQL servers of the fenced-write tests share, like mongod's harness.

Each server is a Debian package's binary started on a free loopback port with its data in a
temporary directory. The servers refuse to run as root, so as root they run as the package's
OS user. ``postgres.py`` and ``mariadb.py`` say how to initialise, start and probe each one.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django_mongolock.testing import free_port

__all__ = ["DebianServer", "apt_install"]


def apt_install(package: str) -> None:
    """Install a Debian package with apt-get (as root), or say how to get it."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"the server binaries are missing: install Debian's {package} package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
        check=True,
        env=env,
        timeout=900,
    )


class DebianServer:
    """One server process on ``127.0.0.1:port``; subclasses name its commands and probe."""

    name = "server"
    os_user = "root"
    stop_signal = signal.SIGTERM
    probe_errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix=f"mongolock-{self.name}-"))
        self.data = self.root / "data"
        self.log = self.root / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            user = pwd.getpwnam(self.os_user)
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def init_command(self) -> Sequence[str]:
        raise NotImplementedError

    def server_command(self) -> Sequence[str]:
        raise NotImplementedError

    def probe(self) -> None:
        """Connect once; raise one of ``probe_errors`` while the server is not ready."""
        raise NotImplementedError

    def start(self, timeout: float = 90.0) -> DebianServer:
        subprocess.run(
            self.init_command(),
            check=True,
            capture_output=True,
            timeout=timeout,
            cwd=self.root,
            **self._as,
        )
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.server_command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                **self._as,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start:\n{self.log.read_text()[-3000:]}")
            try:
                self.probe()
                return self
            except self.probe_errors:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, timeout: float = 60.0) -> None:
        """A clean shutdown, then SIGKILL if it lingers; the directory is removed."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(self.stop_signal)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        shutil.rmtree(self.root, ignore_errors=True)
