"""A session's state: what a Generate call asks (params), the Sequence and its owned
records (sequence), and the table of open sessions with what each is owed (table)."""
