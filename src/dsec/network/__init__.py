"""Per-sandbox egress policy: what a policy means (``policy``) and how a host enforces it
for namespaced sandboxes (``wiring``: a veth into the sandbox's netns, nftables rules)."""
