"""The daemon: wires devices, worker processes and engines to the HTTP API."""
