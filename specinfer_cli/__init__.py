"""The `specinfer` command line: the top of the house, free to use the core, the services'
client and launcher, the gateway and the benchmarks."""

from .main import main

__all__ = ["main"]
