"""Team topology specs: what every spec has, whatever its kind (`spec.py`; each kind's own sections are in
`builders/kinds/`), and the teams' files (`teams/`)."""

from pathlib import Path

TEAMS_DIR = Path(__file__).with_name("teams")
EMBEDDED_SPEC = TEAMS_DIR / "local-cpu.yaml"
