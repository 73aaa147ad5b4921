"""The HTTP API: routes, auth and error mapping, the dashboard, the server's assembly. Which edge
serves a call, and whether a create is admitted, is the control plane's (``dsec.control``)."""
