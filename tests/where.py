"""Where things are, for tests in any folder of `tests/`: the repository, the test helpers,
their fixtures and the shipped suites. Import as `from where import REPO, ...` (pytest puts
`tests/` on the path, beside conftest.py)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
SMOKE = REPO / "suites" / "smoke.yaml"
