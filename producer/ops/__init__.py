"""Operating on jobs after enqueue: listing and cleanup, export, schedules, dashboard, metrics."""
