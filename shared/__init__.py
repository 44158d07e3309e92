"""The wire protocol shared by producers and workers: key names, schemas, blobs, enqueue."""
