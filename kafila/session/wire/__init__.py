"""The one frame codec of every edge stream (ring and weights): typed frames, their field checks,
and the thin asyncio side that reads and writes them. Imports kafila.net only."""
