"""The user documentation, shipped inside the package so that `vlmq help TOPIC` prints the
same pages from a wheel as from a checkout (cli/help.py)."""
