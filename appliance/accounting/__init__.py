"""Per-request records and (later) the chargeback ledger. Knows nothing of HTTP."""
