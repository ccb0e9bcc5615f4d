"""``python -m parallel_latent ...`` is the ``parallel-latent`` command (what launchers run)."""

import sys

from parallel_latent.cli import main

sys.exit(main())
