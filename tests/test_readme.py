"""README.md and .ci/run say the same thing: CI installs with the README's install commands and runs
exactly the README's test command."""

from __future__ import annotations

import re

from tests.helpers.trainer_runs import REPO


def _bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)]


def test_ci_runs_the_readme_commands():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    blocks = _bash_blocks(readme)
    train = next(b for b in blocks if "parallel-latent train --config configs/tiny.yaml --nproc 2" in b)
    assert len(train.splitlines()) == 1, "the first command is one line"
    install = train.split(" && parallel-latent train")[0]
    assert install in ci.splitlines(), f"{install!r} not in .ci/run"
    test_command = next(b for b in blocks if b.startswith("python -m pytest"))
    assert test_command == "python -m pytest tests -q"
    assert ci.strip().splitlines()[-1] == test_command
