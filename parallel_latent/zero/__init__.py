"""DeepSpeed, in one place: the only package that imports it or names its private API.

- :mod:`.version`: the releases this code was written for (:data:`SUPPORTED`) and the one gate every
  part goes through (refused in one line, or one warning where DeepSpeed's own code path is safe);
- :mod:`.patches`: every patch of DeepSpeed's private API (the sync-free bf16 ZeRO-1/2 step, ZeRO-1/2's
  gradients in bulk, the CPU communication kernel skip, the ZeRO optimizer check without Muon, the
  checkpoint engine's load/save hooks);
- :mod:`.engine`: ``deepspeed.initialize`` with those patches, its logs, the ZeRO-3 registration of
  parameters a module borrows from another, the non-finite guard of the bare stage-0 optimizer;
- :mod:`.params`: ZeRO parameter access (gather, write a parameter, fp32 master weights, Adam's moments);
- :mod:`.checkpoint_files`: DeepSpeed's checkpoint files (the weights-only load, the write that keeps the OS's
  reason, the readers of its model and optimizer states of every ZeRO stage).

No module imports DeepSpeed at module level: the command line and the launcher's checks import this
package without its seconds of start-up. The checkpoint package and the training runtime use it;
``parallel/`` and ``model/`` know nothing of it (a module there declares what it needs, such as the
parameters it borrows, and this package tells DeepSpeed).
"""

from .version import SUPPORTED, DeepSpeedVersionError, require_supported_deepspeed

__all__ = ["SUPPORTED", "DeepSpeedVersionError", "require_supported_deepspeed"]
