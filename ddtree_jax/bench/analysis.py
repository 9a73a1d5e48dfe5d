"""What a compiled round does and where its device time goes: HLO checks (host transfers, conditionals, big
copies, per-layer weight copies) and summaries of a jax.profiler trace (kernels by time, busy vs span, gaps)."""

from __future__ import annotations

import math
import re
from typing import Any


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+([\w\-]+)\(")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "pred": 1, "s8": 1, "u8": 1,
          "f64": 8, "s16": 2, "u16": 2}


def hlo_summary(text: str, weight_shapes: set[str] | None = None, top: int = 20) -> dict:
    """What a compiled module does that a round should not: host transfers, conditionals (XLA's GPU runtime
    copies a data-dependent predicate to the host and waits for it), and big buffers made by copies / slices
    (for example a weight or a whole cache copied every step)."""
    host = {pat: len(re.findall(pat, text)) for pat in
            (r"\binfeed\(", r"\boutfeed\(", r"\bsend\(", r"\brecv\(", r"\bsend-done\(", r"\brecv-done\(")}
    targets: dict[str, int] = {}
    for t in re.findall(r'custom_call_target="([^"]+)"', text):
        targets[t] = targets.get(t, 0) + 1
    callbacks = {t: c for t, c in targets.items() if "callback" in t.lower() or "host" in t.lower()}
    big, copies, weight_like = [], [], []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, dt, dims, op = m.groups()
        if op in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dt, 4)
        meta = re.search(r'op_name="([^"]+)"', line)
        entry = {"name": name, "op": op, "shape": f"{dt}[{dims}]", "bytes": size,
                 "op_name": meta.group(1)[-120:] if meta else ""}
        if "calls=" in line:
            entry["calls"] = re.search(r"calls=%?([\w.\-]+)", line).group(1)
        if size >= (8 << 20):
            big.append(entry)
        if op in ("copy", "copy-start") and size >= (1 << 20):
            copies.append(entry)
        bare = ",".join(d for d in dims.split(",") if d) if dims else ""
        while bare.startswith("1,"):
            bare = bare[2:]
        if weight_shapes and op in ("fusion", "fusion-done", "copy", "copy-done", "dynamic-slice", "slice") \
                and f"{dt}[{bare}]" in weight_shapes:
            weight_like.append(entry)
    big.sort(key=lambda e: -e["bytes"])
    async_slices = len(re.findall(r"fusion-start\(.*dynamic_slice", text))
    return {
        "host_transfer_ops": host, "host_callbacks": callbacks, "custom_call_targets": targets,
        "while_loops": len(re.findall(r"\swhile\(", text)), "fusions": len(re.findall(r"\sfusion\(", text)),
        "conditionals": len(re.findall(r"\sconditional\(", text)),  # on GPU the host reads each one's predicate
        "copies_over_1MiB": copies[:top], "n_copies_over_1MiB": len(copies),
        "largest_buffers": big[:top], "weight_shaped_outputs": weight_like[:top],
        "n_weight_shaped_outputs": len(weight_like), "async_dynamic_slice_copies": async_slices,
        "hlo_chars": len(text),
    }


def weight_shape_strings(tp, dp) -> set[str]:
    """'bf16[4096,12288]'-style strings of one layer's weight matrices (a per-layer copy would show them)."""
    import jax

    out = set()
    for layers in (tp.layers, dp.layers):
        stacked = not isinstance(layers, (tuple, list))
        for x in jax.tree.leaves(layers if stacked else layers[0]):
            dims = x.shape[1:] if stacked else x.shape
            if len(dims) >= 2:
                out.add(f"{_dtname(x.dtype)}[{','.join(str(d) for d in dims)}]")
    for x in (tp.lm_head, tp.embed):
        if x is not None:
            out.add(f"{_dtname(x.dtype)}[{','.join(str(d) for d in x.shape)}]")
    return out


def _dtname(dt) -> str:
    return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}.get(str(dt), str(dt))


def busy_and_gaps(spans: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """Kernel intervals (start, end) sorted by start -> (time some interval covers, the idle gaps between them)."""
    busy, gaps, (cur_s, cur_e) = 0, [], spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s, gaps


def profile_summary(path: str, top: int = 25, modules_kept: int = 40, host_top: int = 40) -> dict:
    """Summarise a jax.profiler xplane.pb: device kernels by total time, busy vs span, gaps, memcpys, and the first
    ``modules_kept`` executions of compiled programs in time order; and the ``host_top`` host events (the runtime's
    own annotations, e.g. an executable's launch and its thunks, on every host thread) by total time, under "host"."""
    import jax

    pd = jax.profiler.ProfileData.from_file(path)
    out: dict[str, Any] = {"planes": []}
    for plane in pd.planes:
        lines = list(plane.lines)
        out["planes"].append({"name": plane.name, "lines": [ln.name for ln in lines][:12]})
        if plane.name.startswith("/host:CPU"):
            events: dict[str, list[float]] = {}
            for ln in lines:
                for e in ln.events:
                    events.setdefault(e.name, []).append(e.duration_ns / 1e3)
            ranked = sorted(((sum(v), len(v), k) for k, v in events.items()), reverse=True)
            out["host"] = {"top_events": [{"name": k[:140], "total_us": t, "count": c}
                                          for t, c, k in ranked[:host_top]]}
        if not plane.name.startswith("/device:"):
            continue
        kernels: dict[str, list[float]] = {}
        spans = []
        memcpy: dict[str, int] = {}
        modules = []
        for ln in lines:
            evs = list(ln.events)
            if ln.name.startswith("XLA Modules"):
                modules += [(e.name, e.start_ns, e.duration_ns / 1e3) for e in evs]
            if not ln.name.startswith("Stream"):
                continue
            for e in evs:
                nm = e.name
                low = nm.lower()
                if "memcpy" in low or "memset" in low:
                    key = next((d for d in ("dtoh", "d2h", "htod", "h2d", "dtod", "d2d", "memset") if d in low), low[:20])
                    memcpy[key] = memcpy.get(key, 0) + 1
                kernels.setdefault(nm, []).append(e.duration_ns / 1e3)
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
        if not spans:
            continue
        spans.sort()
        busy, gaps = busy_and_gaps(spans)
        gaps = [g / 1e3 for g in gaps]
        total = sorted(((sum(v), len(v), k) for k, v in kernels.items()), reverse=True)
        out[plane.name] = {
            "span_us": (spans[-1][1] - spans[0][0]) / 1e3, "busy_us": busy / 1e3,
            "n_events": len(spans), "gaps_over_5us": sum(g > 5 for g in gaps),
            "gap_us_over_5us": sum(g for g in gaps if g > 5), "largest_gaps_us": sorted(gaps)[-8:],
            "memcpy_counts": memcpy,
            "top_kernels": [{"name": k[:140], "total_us": t, "count": c} for t, c, k in total[:top]],
            "modules": [{"name": n[:80], "start_us": (t - spans[0][0]) / 1e3, "us": d}  # start: from the first kernel
                        for n, t, d in sorted(modules, key=lambda m: m[1])[:modules_kept]],
        }
    return out
