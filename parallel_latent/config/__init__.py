"""Run configuration: YAML files validated into typed dataclasses, one per concern.

- :mod:`.schema`: the machinery (a key's default, meaning and bound; dict -> dataclass);
- :mod:`.sections`: the sections, each with its own rules, and :func:`validate_config`, the rules
  that span sections (:mod:`.export_section`: encode-corpus's section, re-exported there);
- :mod:`.io`: files and ``key=value`` overrides;
- :mod:`.compatibility`: what a checkpoint's recorded model config means today.

Torch-free, so that the command line validates a config before it loads anything heavy.
"""

from . import compatibility, io, schema, sections
from .compatibility import *  # noqa: F403 (the package's names are its modules' __all__)
from .io import *  # noqa: F403
from .schema import *  # noqa: F403
from .sections import *  # noqa: F403

__all__ = compatibility.__all__ + io.__all__ + schema.__all__ + sections.__all__
