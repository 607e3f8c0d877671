"""The view models of the console's screens, one module per screen (`tui/screens/`)."""
