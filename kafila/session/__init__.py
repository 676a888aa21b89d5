"""A Kafila session, in four rooms that import only downward (tests/test_core_imports.py):

- `control/`  the control plane: the participant and host drivers, the lifecycle machines, the
              host <-> member control messages, replans and the plan's preview.
- `ring/`     the data plane: the ring node, the head's driver and scheduler, micro-batches, slots,
              the prompt cache, timing; `ring/speculation/` holds n-gram, draft-model, origin and
              live DiP-SD drafting.
- `weights/`  weight movement: the manifest and cache, the transfer over an edge, the sealed bulk
              lane, and the TCP lane ring frames take when they can.
- `wire/`     the one frame codec every edge stream speaks (ring and weights), its field checks and
              its asyncio stream side.

control -> ring, weights -> wire -> kafila.net.
"""
