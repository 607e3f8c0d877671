"""Worker processes: one engine each, started by the daemon as `applianced worker`."""
