"""The control plane: who is in the session, the plan, its lifecycle, and the drivers that run it.

Imports ring/, weights/, wire/ and kafila.net; nothing below imports it."""
