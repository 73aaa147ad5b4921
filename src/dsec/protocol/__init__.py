"""The wire contract between the SDK, the API server and the edges: what an operation on a
sandbox is (``ops``), with the models and errors it carries.

Everything here is data and pure functions, so the SDK and every server layer can share it
without pulling in the server; the layers check themselves against it (tests/unit).
"""
