"""Team topology specs: the spec model (`spec.py`) and the teams' files (`teams/`)."""

from pathlib import Path

TEAMS_DIR = Path(__file__).with_name("teams")
EMBEDDED_SPEC = TEAMS_DIR / "local-cpu.yaml"
