"""The client's tests: most against a real gateway (see support.py), a few against a local
server that misbehaves on purpose (test_transport_faults.py)."""
