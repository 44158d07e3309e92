"""Writing results: per-item results (ending jobs through worker/jobs), the result cache."""
