"""The wire, shared by every process of the run (the relay's raw TCP frames are in echo2/broadcast/).

``http``        HTTP + JSON servers and clients: credentials judged on the headers, bodies bounded, routes in threads
``httpd``       the machinery under every server: uvicorn's protocol with deadlines and connection caps
``tls``         the per-run CA, the certificates it issues, pinning, and a worker's join
``rendezvous``  ``<run dir>/coordinator.json``: where workers that start first find the learner

Worker credentials (``name:HMAC(run secret, name)``) and their command-line tool are in echo2/credential.py; who
may call which coordinator route is echo2/coordinator/gate.py.
"""
