"""
pdkv's lab helpers: benchmark ceilings and the netlab delay line (not part of `import pdkv`)
"""
from __future__ import annotations
from . import bench
from . import netlab
__all__: list[str] = ['bench', 'netlab', 'pybind11_version']
pybind11_version: str = '3.1.0'
