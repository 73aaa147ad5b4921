"""The per-host edge: admission, lifecycle, reaper, cleanup."""
