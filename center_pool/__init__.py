"""The center pool worker: runs placed vision jobs on a GPU/NPU/CPU server, in batches.

``service.serve`` wires a worker together (``sluicegate pool run``); ``worker.PoolWorker`` is
the asyncio shell; the decisions it makes are pure and live beside it: ``intake`` (what a work
message must carry, token first), ``batching`` (which jobs run together, and when),
``reporting`` (capabilities, telemetry, service times). ``gate`` checks tokens and replays,
``guard`` holds the audit log and replay cache, ``hardware`` reads providers and the device.
"""
