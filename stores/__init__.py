"""Where referenced inputs live: folder and S3 stores, read by path and verified by hash."""
