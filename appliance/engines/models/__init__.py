"""One module per model architecture the torch engine runs."""
