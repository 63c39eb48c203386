"""docker/README.md's `.env` steps, run as written after `cp .env.example .env` (#51): each
setting ends up on one line (compose takes the last of two, other readers the first)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_env_steps_leave_one_line_per_setting(tmp_path):
    text = (ROOT / "docker" / "README.md").read_text(encoding="utf-8")
    block = next(
        b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "set_env ELMO_REDIS" in b
    )
    steps = "\n".join(line for line in block.splitlines() if "set_env" in line)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    subprocess.run(["bash", "-euc", steps], cwd=tmp_path, check=True, timeout=60)
    keys = [
        line.split("=", 1)[0]
        for line in (tmp_path / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert len(keys) == len(set(keys)), keys
    assert {"ELMO_REDIS_PASSWORD", "PYTHON_IMAGE", "TORCH_INDEX_URL"} <= set(keys)
    password = next(
        line for line in (tmp_path / ".env").read_text().splitlines() if line.startswith("ELMO_R")
    )
    assert len(password.split("=", 1)[1]) == 48
