"""Run the benchmark suite: ``python benchmarks/run.py [--quick] [--only NAME] [--help]``."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path; the project root is
# appended (not prepended) so that a PYTHONPATH naming another django_mongolock still wins.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benchmarks.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
