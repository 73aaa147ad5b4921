"""dsec's benchmarks (``dsec bench``), import package ``dsec_benchmarks``.

Not part of the dsec distribution: ``benchmarks/pyproject.toml`` installs them from a checkout
(``scripts/setup`` does), and ``dsec bench`` says how when they are missing."""
