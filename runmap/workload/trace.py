"""Route traces (schemas/route-trace.schema.json): what every MoE layer routed at every step of a run.

A trace holds streams; a stream is one row of a run (one prompt) and its routes are an int array
(steps, num_layers, top_k): prompt tokens first, then one step per decode forward pass.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np

from runmap import atomic
from runmap.provenance import utc_timestamp

SCHEMA = "runmap-route-trace-v1"


class TraceError(ValueError):
    """A trace file that is missing, not JSON, against its schema, or whose arrays do not match their shapes."""


@dataclasses.dataclass
class RouteTrace:
    arch: str
    num_layers: int
    num_experts: int
    top_k: int
    routing: str
    streams: list  # np.ndarray int64 (steps, num_layers, top_k) per stream
    prompt_tokens: list  # int per stream
    pack_identity: str | None = None

    def layer_steps(self, layer: int, *, decode_only: bool = False) -> list[list[list[int]]]:
        """Per stream, the step list of ``layer`` (the layout runmap.workload.replay takes)."""
        out = []
        for s, p in zip(self.streams, self.prompt_tokens):
            a = s[p:] if decode_only else s
            out.append(a[:, layer, :].tolist())
        return out

    def to_dict(self) -> dict:
        dtype = np.uint8 if self.num_experts <= 256 else np.uint16
        streams = []
        for s, p in zip(self.streams, self.prompt_tokens):
            a = np.ascontiguousarray(np.asarray(s).reshape(-1, self.num_layers, self.top_k), dtype=dtype)
            streams.append({"prompt_tokens": int(p), "steps": int(a.shape[0]),
                            "experts": base64.b64encode(a.astype(a.dtype.newbyteorder("<")).tobytes()).decode()})
        return {"schema": SCHEMA, "created_utc": utc_timestamp(), "arch": self.arch,
                "pack_identity": self.pack_identity, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "top_k": self.top_k, "routing": self.routing,
                "dtype": np.dtype(dtype).name, "streams": streams}


def write_trace(path, trace: RouteTrace) -> Path:
    """Write ``trace`` to ``path`` atomically (a temporary sibling, then rename)."""
    return atomic.write_json(path, trace.to_dict(), indent=None)


def read_trace(path) -> RouteTrace:
    """Read and check a trace; TraceError naming the file and the field otherwise."""
    from runmap.conformance.schemas import validate_document

    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{p}: not a JSON route trace ({e})") from None
    bad = validate_document(doc, "route-trace.schema.json", file=str(p))
    if bad:  # a Violation names the file itself
        raise TraceError(f"{bad[0]} (not a route trace: `runmap generate --trace FILE` writes one)")
    L, E, k = doc["num_layers"], doc["num_experts"], doc["top_k"]
    dtype = np.dtype(doc["dtype"]).newbyteorder("<")
    streams, prompts = [], []
    for i, s in enumerate(doc["streams"]):
        raw = base64.b64decode(s["experts"])
        if len(raw) != s["steps"] * L * k * dtype.itemsize:
            raise TraceError(f"{p}: streams[{i}].experts holds {len(raw)} bytes; steps x layers x top_k = "
                             f"{s['steps']} x {L} x {k} {doc['dtype']} needs {s['steps'] * L * k * dtype.itemsize}")
        a = np.frombuffer(raw, dtype=dtype).astype(np.int64).reshape(s["steps"], L, k)
        if a.size and a.max() >= E:
            raise TraceError(f"{p}: streams[{i}] names expert {int(a.max())}; the trace's model has {E} experts")
        if s["prompt_tokens"] > s["steps"]:
            raise TraceError(f"{p}: streams[{i}].prompt_tokens={s['prompt_tokens']} exceeds its {s['steps']} steps")
        streams.append(a)
        prompts.append(s["prompt_tokens"])
    return RouteTrace(doc["arch"], L, E, k, doc["routing"], streams, prompts, doc.get("pack_identity"))
