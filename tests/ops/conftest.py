import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "ssd"))  # server_proc: a real `promptcache serve`


@pytest.fixture
def artifacts_dir() -> Path:
    """Where tests leave artifacts (screenshots): ``$PROMPTCACHE_ARTIFACTS`` or
    ``<repo>/tmp/artifacts`` (gitignored)."""
    env = os.environ.get("PROMPTCACHE_ARTIFACTS")
    path = Path(env) if env else HERE.parent.parent / "tmp" / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path
