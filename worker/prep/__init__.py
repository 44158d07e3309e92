"""Preparing items on CPU threads: fetch, decode and render, text layers, the vision cache."""
