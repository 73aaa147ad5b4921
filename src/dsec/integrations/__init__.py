"""Adapters that let agent harnesses use dsec sandboxes unchanged."""
