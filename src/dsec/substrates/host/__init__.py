"""Host mechanisms the substrates share: cgroups, sandbox disks, the OCI config and seccomp
filter, spawning and watching processes, removing trees."""
