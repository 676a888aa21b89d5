"""The Kafila rendezvous: session registry, signaling, STUN on two ports, ciphertext relay.

It holds no weights and sees no plaintext: members' signaling bodies are sealed with keys from a
PAKE whose password (the words of the code) never reaches it, and relayed datagrams are QUIC.
Protocol logic is sans-I/O (registry, relay, stun, messages, frames); `service` is the asyncio
layer. Run it with `kafila rendezvous [--listen HOST:PORT]`.
"""

from rendezvous.errors import ProtocolError

__all__ = ["ProtocolError", "Rendezvous"]


def __getattr__(name: str):  # keep `import rendezvous` free of asyncio for the sans-I/O users
    if name == "Rendezvous":
        from rendezvous.service import Rendezvous

        return Rendezvous
    raise AttributeError(name)
