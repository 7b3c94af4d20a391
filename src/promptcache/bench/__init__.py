"""The benchmark harness behind `promptcache bench` (issue 6).

- ``scenarios``: the deterministic S1..S5 (and E1) conversation generators.
- ``concurrent_plans``: the concurrent scenarios' requests (C1, C2, E2..E4).
- ``concurrency``: runs them on every system, timed and summarized.
- ``shared``: S6, two servers sharing one Redis.
- ``systems``: start / stop / kill each system under test on a free port, sample peak RSS.
- ``redisproc``: redis-server processes and a delaying TCP proxy.
- ``client``: streaming OpenAI / Anthropic clients measuring TTFT to the first content token.
- ``floor``: the in-process prefill floor per turn (mlx-lm).
- ``runner``: replays a scenario against one system.
- ``report``: JSON, Markdown tables and PNG charts.

The repository's ``bench/bench_*.py`` scripts (developer benchmarks, not installed)
import the helpers they share from here (``systems.free_port``, ``systems.dir_bytes``,
``redisproc.RedisServer``) rather than keeping copies.
"""
