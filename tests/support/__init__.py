"""Helpers of the tests: imported by them (``support.chaos``) or run as files, in sandboxes or
beside the server (probes, workers, the E2B driver, fuzz hooks). Not tests themselves."""
