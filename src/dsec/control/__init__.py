"""The control plane: which edges there are (a directory, local or on Ray), where a sandbox
or a call goes (the router and placement), and who may do what (projects, quotas). Composed
once per server by ``compose`` (embedded edge, or the edges of a Ray cluster); the HTTP
front-ends (``api/``, ``compat/``) only build routes on top of a ``ControlPlane``."""
