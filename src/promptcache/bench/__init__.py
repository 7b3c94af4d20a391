"""The benchmark harness behind `promptcache bench` (issue 6).

- ``scenarios``: the deterministic S1..S5 conversation generators.
- ``systems``: start / stop / kill each system under test on a free port, sample peak RSS.
- ``client``: streaming OpenAI / Anthropic clients measuring TTFT to the first content token.
- ``floor``: the in-process prefill floor per turn (mlx-lm).
- ``runner``: replays a scenario against one system.
- ``report``: JSON, Markdown tables and PNG charts.
"""
