"""`.ci/run` is the newcomer's path: a fresh virtual environment and the README Quickstart's two commands,
read from the README itself, with nothing installed before them."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    return block.splitlines()


def test_ci_runs_the_quickstart_commands_as_the_readme_writes_them():
    script = (ROOT / ".ci" / "run").read_text()
    (extract,) = [ln for ln in script.splitlines() if ln.startswith("mapfile -t commands")]
    got = subprocess.run(["bash", "-c", f'{extract}\nprintf "%s\\n" "${{commands[@]}}"'], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert got == _quickstart() and len(got) == 2
    assert got[0].startswith("python3 -m pip install -e . ") and got[1].endswith("python3 -m pytest -q")
    assert "pip install" not in script and "python3 -m venv" in script  # nothing installed before them
