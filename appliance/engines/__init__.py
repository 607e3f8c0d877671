"""Inference engines. Nothing here knows about HTTP: the daemon drives engines through
worker processes and the messages in `messages.py`."""
