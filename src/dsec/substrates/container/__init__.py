"""The container substrate: OCI runtimes (crun, runc, runsc) over the image's layers."""
