"""Opening inputs (image formats, TIFF pages, PDF pages) with one set of caps for
producer, worker and dashboard."""
