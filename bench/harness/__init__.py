"""The benchmark harness behind `promptcache bench` (issue 6): not part of the installed
package; ``cli/bench_cmd.py`` finds this folder in a source checkout and hands it the
command (``command``).

- ``command``: the options of `promptcache bench` and the run.
- ``scenarios``: the deterministic S1..S5 (and E1) conversation generators.
- ``concurrent_plans``: the concurrent scenarios' requests (C1, C2, E2..E4).
- ``concurrency``: runs them on every system, timed and summarized.
- ``shared``: S6, two servers sharing one Redis.
- ``soak``: the soak, agent sessions with churn for minutes, sampling what the server holds.
- ``systems``: start / stop / kill each system under test on a free port, sample peak RSS.
- ``redisproc``: redis-server processes and a delaying TCP proxy.
- ``client``: streaming OpenAI / Anthropic clients measuring TTFT to the first content token.
- ``floor``: the in-process prefill floor per turn (mlx-lm, in ``prefill``).
- ``runner``: replays a scenario against one system.
- ``report``: JSON, Markdown tables and PNG charts.

The ``bench/bench_*.py`` scripts import it as ``harness`` (Python puts ``bench/`` on
``sys.path`` when it runs a script there), and so do the tests (``pythonpath`` in
pyproject.toml's pytest options): ``systems.free_port``, ``systems.dir_bytes``,
``redisproc.RedisServer`` have one home.
"""
