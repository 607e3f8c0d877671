"""One module per kind of layer the torch engine's models are built from."""
