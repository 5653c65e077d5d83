"""Inference servers the user runs (`--backend http`), driven over their own HTTP API:
each server one member of the fleet (`member.py`), what they share and the fleet around
them (`transport.py`), the server kinds' paths and field names (`dialects.py`), and the
servers behind a headless Service (`discovery.py`)."""
