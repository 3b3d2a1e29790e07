"""The test's side of ``tests.fencing.holder``: start it, stop/continue it, talk to it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


class HolderProcess:
    """A holder in a process of its own; every wait for its answer is bounded."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fencing.holder", json.dumps(config)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the holder said nothing in {timeout}s") from None
        if line is None:
            stderr = self.process.stderr.read() if self.process.stderr else ""
            raise AssertionError(f"the holder ended ({self.process.wait()}):\n{stderr}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def write(self, body: str, timeout: float = 60.0) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"write {body}\n")
        self.process.stdin.flush()
        return self.answer(timeout)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.process.poll() is None:  # a holder that ended (and was reaped) is not signalled
            self.resume()
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
