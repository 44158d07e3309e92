"""Writing results: per-item results, the result cache, and each job's end."""
