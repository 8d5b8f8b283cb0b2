"""``python -m kvcert.kernels build``."""

import sys

from . import main

sys.exit(main())
