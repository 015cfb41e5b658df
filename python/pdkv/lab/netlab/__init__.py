"""``pdkv netlab``: hosts in network namespaces behind emulated links on one machine
(:mod:`~pdkv.lab.netlab.testbed`), and the elastic serving deployment across them
(:mod:`~pdkv.lab.netlab.discovery`)."""
