"""The paths tests read, from the repository root: one place, so a test file's depth under tests/ does not matter."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
MICRO = FIXTURES / "micro.yaml"
