"""Trajectory log: every call of an attached sandbox, durably logged in order with its result.

- ``log``: the durable log in the state store, large bytes in its blob area
- ``recorder``: fast-forward and recording at the edge boundary, forks
- ``replay``: re-executing a log into a sandbox, with a step-by-step diff
- ``export``: provenance as JSONL

What a call is and its digest, and a result as logged, are shared with the SDK: they live in
``dsec.protocol`` (``digest``, ``outcome``). Nothing here is imported eagerly.
"""
