"""The model itself: BLAS set-up, load defaults, the offline tiny model, `vlmq model check`."""
