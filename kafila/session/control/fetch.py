"""Weight fetch: a member's shard of the model from the host, or its own copy when the digests
match. Over the host's TCP bulk lane when it is reachable, else the QUIC edge; resumable,
SHA-256 checked per tensor, and the manifest must be exactly this member's shard of the plan
(weights.check_shard). Progress goes to /status live and to a bar in a terminal."""

from __future__ import annotations

import asyncio
import time

from backends.errors import BadInput
from kafila.session.control.system import close_quietly, punched_host
from kafila.session.weights.bulk import dial as bulk_dial
from kafila.session.weights.manifest import Manifest, TransferProgress, WeightError, check_shard, local_copy_path


async def fetch_weights_from(stage, manifest: Manifest, host: str) -> tuple[str, dict]:
    """(the model file's path here, the weights' /status row) for `stage` (stage.Stage), whose
    plan role decides which shard `manifest` must be."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )  # fmt: skip

    from kafila.session.weights.transfer import Lanes, check_local_file, fetch_weights

    cfg = stage.cfg
    if cfg.local_model and await asyncio.to_thread(check_local_file, cfg.local_model, manifest):
        stage.say(f"{cfg.name}: using the local copy {cfg.local_model} (same SHA-256)")
        return cfg.local_model, {"received_bytes": 0, "tensor_bytes": manifest.tensor_bytes,
                                 "source": "local file"}  # fmt: skip
    path = local_copy_path(cfg.cache_dir, manifest)
    stage.state.weights = {"source": "host", "tensor_bytes": manifest.tensor_bytes, "done_bytes": 0,
                           "total_bytes": manifest.tensor_bytes, "state": "connecting"}  # fmt: skip
    edge = await stage.net.connect(host)
    # the TCP lane tries where the edge already reached the host first (its punched address)
    prefer = punched_host(edge)
    lanes = None if cfg.weights_lane == "quic" else Lanes(lambda offer: bulk_dial(offer, prefer))

    def lane() -> str:
        return lanes.lane if lanes is not None else "quic"

    try:
        reader, writer = await edge.open_stream()
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=stage.console,
                      disable=not stage.console.is_terminal) as bar:  # fmt: skip
            task = bar.add_task(f"{cfg.name}: weights", total=manifest.tensor_bytes)
            live = TransferProgress(manifest.tensor_bytes, time.monotonic())

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)
                live.update(done, time.monotonic(), total)  # /status and the page, live
                stage.state.weights = {"source": "host", "tensor_bytes": manifest.tensor_bytes,
                                       "lane": lane(), **live.as_dict()}  # fmt: skip

            stats = await fetch_weights(reader, writer, cfg.name, manifest, path, progress,
                                        shard_check(manifest, stage.role, cfg.name), lanes)  # fmt: skip
    finally:
        await close_quietly("the weights edge", edge.close())
    live.finish(time.monotonic())
    mb = stats["received_bytes"] / 1e6
    secs = max(stats["seconds"], 1e-6)
    how = ("over TCP" if stats["lane"] == "tcp" else
           f"over the QUIC stream ({lanes.note})" if lanes is not None and lanes.note else "over the QUIC stream")
    stage.say(f"{cfg.name}: weights ready: {stats['fetched_tensors']} of {len(manifest.tensors)} "
              f"tensors fetched, {mb:.1f} MB in {secs:.1f} s ({mb / secs:.1f} MB/s {how}), SHA-256 verified")  # fmt: skip
    stage.event("weights", **stats)
    stage.state.weights = {**live.as_dict(), **stats, "source": "host"}
    if lanes is not None and lanes.note:
        stage.state.weights["lane_note"] = lanes.note[:300]
    return path, stage.state.weights


def shard_check(manifest: Manifest, role, me: str):
    """For fetch_weights: once the copy's header is verified, the manifest must be exactly this
    member's shard of that model (weights.check_shard). Blocking. None without a plan (a fetch
    on its own, as in tests): there is no shard to check against."""
    if role is None:
        return None

    def check(path: str) -> None:
        from backends.gguf import open_model

        try:
            index = open_model(path)
        except BadInput as exc:
            raise WeightError(f"the model header the host sent cannot be read: {exc}") from None
        check_shard(manifest, index, role.first, role.last, role.head == me)

    return check


__all__ = ["fetch_weights_from", "shard_check"]
