"""Run the dsec benchmark: ``python benchmarks/run.py [--quick] [--json FILE]``."""

from dsec.cli import bench

if __name__ == "__main__":
    bench()
