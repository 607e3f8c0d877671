"""The Textual TUI (a later issue): a client of the daemon's admin API only."""
