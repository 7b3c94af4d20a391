"""Long sessions at 8K-128K tokens (``harness/long_run.py``; also
``promptcache bench --scenarios long``).

    PYTHONPATH=src:bench python bench/bench_long_session.py [--shape small] \\
        [--sizes 8192,16384,32768] [--new 256] [--redis] [--out FILE.json]
"""

from __future__ import annotations

import sys

from harness.long_run import run

if __name__ == "__main__":
    print(run(sys.argv[1:]))
