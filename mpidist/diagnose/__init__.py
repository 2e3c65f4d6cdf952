"""Finding out what went wrong: debug levels and per-call checks (``debug``), and the
survey of what every rank is waiting in when a call times out (``stall``)."""
