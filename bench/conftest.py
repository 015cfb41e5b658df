"""pytest-benchmark suites (not collected by `pytest`; run `pytest bench/ --benchmark-only`)."""

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NIXL/UCX: loopback only on shared machines
