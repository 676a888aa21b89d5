"""The data plane: hidden states round the ring, the head's scheduling, slots and prompt cache.

Imports wire/ and kafila.net (never control/ or weights/)."""
