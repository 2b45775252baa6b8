"""The `trainbridge` command line: the root app (app.py) and each command's module."""
