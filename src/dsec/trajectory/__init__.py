"""Trajectory log: every call of an attached sandbox, durably logged in order with its result.

- ``digest``: what a call is, canonically, and its digest (shared with the SDK)
- ``outcome``: a call's result as logged (shared with the SDK)
- ``log``: the durable log in the state store, large bytes in its blob area
- ``recorder``: fast-forward and recording at the edge boundary, forks
- ``replay``: re-executing a log into a sandbox, with a step-by-step diff
- ``export``: provenance as JSONL

Only the first two are imported by the SDK; nothing here is imported eagerly.
"""
