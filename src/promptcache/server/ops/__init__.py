"""Operations: admin endpoints, metrics, dashboard, history, alerts, diagnostics, probe, packs, sessions, request log; they subscribe to ``RequestFinished``."""
