"""Taking jobs: claiming them from RQ, fencing, heartbeats, guards, poison records, job settings."""
