"""Weight movement: each member's own tensors' byte ranges, verified and resumable, over the QUIC
edge or the sealed TCP bulk lane; and the TCP lane ring frames take when a peer is reachable.

Imports wire/ and kafila.net (never control/ or ring/)."""
