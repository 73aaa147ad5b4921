"""API server: HTTP routes, auth, routing to edges."""
