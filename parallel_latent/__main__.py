"""``python -m parallel_latent ...`` is the ``parallel-latent`` command (what launchers run)."""

import sys

from parallel_latent.console import redirect_worker_output

redirect_worker_output()  # a rank of `train --nproc` other than 0 writes to its log file, from the start

from parallel_latent.cli import main  # noqa: E402

sys.exit(main())
