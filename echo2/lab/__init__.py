"""Lab tools: what measures and emulates the system, never shipped to workers (no module outside echo2/lab imports
it; tests/repo/test_docs.py checks). Tests, benchmarks and launchers/wan.py use them.

``testbed``    emulated WAN hosts in network namespaces behind shaped links (needs root)
``delayline``  the packet delay the testbed uses (NFQUEUE; the kernel here has no netem)
``link``       in-process link emulation for tests without root: token buckets and a latency around each of the
               relay's connections (the relay takes it by keyword)
``bench``      ``python -m echo2.lab.bench``: how long until every worker holds a verified snapshot
"""
