"""State store: SQLite embedded by default, PostgreSQL when scaled out (``db.py``)."""
