"""The RQ job lifecycle, whole: taking, running, fencing, heartbeats, guards, poison, ends."""
