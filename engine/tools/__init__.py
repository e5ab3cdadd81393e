"""Command-line tools (`python -m engine.tools.<name>`)."""
