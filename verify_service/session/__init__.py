"""A session's state: what a Generate call asks (params), and the Sequence with its owned
records (sequence). The table of open sessions is verify_service/sessions.py."""
