"""``python -m django_mongolock.testing serve``."""

import sys

from django_mongolock.testing.serve import main

sys.exit(main())
