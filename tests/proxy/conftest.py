import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Launcher  # noqa: E402


@pytest.fixture(scope="session")
def launcher():
    """Forks CLI runs from a warm interpreter (each run is still its own process)."""
    lau = Launcher(fresh=False)
    yield lau
    lau.close()


@pytest.fixture(scope="session")
def fresh_launcher():
    """Starts every CLI run as a brand-new interpreter (slower; proves nothing leaks via fork)."""
    lau = Launcher(fresh=True)
    yield lau
    lau.close()
