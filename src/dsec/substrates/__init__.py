"""Substrates: one interface, one module per kind of isolation."""
