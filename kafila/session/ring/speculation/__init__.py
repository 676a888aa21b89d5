"""Speculative decoding on the ring: n-gram and draft-model drafts, drafts at the origin member
(DiP-SD's local drafting) and the live DiP-SD optimiser. Imports wire/ only, of the session."""
