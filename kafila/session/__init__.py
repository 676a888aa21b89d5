"""A Kafila session: lifecycle (host, member), weight transfer, the ring data plane, RingEngine."""
