"""How long after redis-server comes back the Redis tier uses it again (a script, not a
test): kill redis-server, make the tier fail (its circuit opens), wait ``down`` seconds
(the breaker's backoff grows while the prober's pings fail), restart it on the same
port, and time until the circuit is closed. The real prober thread, real clock.

usage: python bench/bench_redis_recovery.py [--down 5 40]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness.redisproc import RedisServer
from promptcache.config import RedisConfig
from promptcache.errors import TierError
from promptcache.meta import Namespace
from promptcache.tiers.redis import RedisTier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--down", type=float, nargs="+", default=[5.0, 40.0])
    args = ap.parse_args()
    srv = RedisServer(Path(tempfile.mkdtemp())).start()
    tier = RedisTier(RedisConfig(url=srv.url))
    ns = Namespace("bench-recovery", 4)
    try:
        for down in args.down:
            srv.kill()
            for _ in range(tier.config.breaker_failures):
                try:
                    tier.get_metas([b"\0" * 32], ns=ns)  # type: ignore[list-item]
                except TierError:
                    pass
            time.sleep(down)
            srv.start()
            t0 = time.monotonic()
            while not tier.healthy:
                time.sleep(0.01)
            print(f"down {down:.0f} s: circuit closed {time.monotonic() - t0:.2f} s after the "
                  f"restart (cap {tier.config.breaker_max_backoff_s:.0f} s + probe interval "
                  f"{tier.config.probe_interval_s} s)")
    finally:
        tier.close()
        srv.stop()


if __name__ == "__main__":
    main()
