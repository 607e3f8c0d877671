"""`applianced tui`: a live Textual console for one appliance or a fleet.

A client of the daemon's admin API only (never a second NVML poller): `feed` reads each
appliance's snapshots over HTTP, `model` turns JSON into what is shown (and is shared
with `applianced status`), `app` and `screens/` draw it.
"""
