"""State store: SQLite embedded by default."""
