"""The training loop and the stop signals it answers."""
