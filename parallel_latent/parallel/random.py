"""The old name of :mod:`parallel_latent.parallel.dropout` (keyed dropout), kept for one release:
``parallel_latent.parallel.random`` is that module itself."""

import sys

from . import dropout

sys.modules[__name__] = dropout
