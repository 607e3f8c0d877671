"""Model checkpoints the appliance can make for itself, and model shapes for the simulator."""
