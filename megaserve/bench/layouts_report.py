"""The tables and files of ``megaserve bench device-layouts`` (megaserve/bench/device_layouts.py):
the per-GPU table against the baseline, one payload of several runs (``--merge``), the
planner's measurement file of a payload's rows (planner/measurements.py)."""

from __future__ import annotations

import json
import os


def measurement_runs(rows: list[dict]) -> list[dict]:
    """The planner's runs (planner/measurements.py) of the rows it can express: a steady
    row as a decode-only run, a whole row as a run with prefill (``dp:N`` as one of its N
    one-GPU engines; ``attnR:E`` is left out)."""
    runs = []
    for r in rows:
        kind, _, arg = r["layout"].partition(":")
        if kind == "colocated":
            where = {"layout": "colocated"}
        elif kind == "ep":
            where = {"layout": "colocated", "ep": int(arg)}
        elif kind == "split":
            where = {"layout": "disaggregated", "n_e": 1, "m": r["m"]}
        elif kind == "dp":
            where = {"layout": "colocated"}  # N independent one-GPU engines: one of them
        else:
            continue  # attnR:E has no planner run kind
        # A DP row is recorded as one of its engines: its sequences and tok/s divided by N.
        copies = r["replicas"] if kind == "dp" else 1
        shape = {"input_len": r["input_len"], "output_len": r["output_len"]}
        if isinstance(r.get("async_scheduling"), bool):  # the planner predicts each run under its scheduling
            shape["async_scheduling"] = r["async_scheduling"]
        runs.append({**where, **shape, "batch": r["seqs"] // copies, "step_ms": round(r["ms_step"], 3),
                     "tok_s": round(r["tok_s"] / copies, 1)})
        if "whole_tok_s" in r:
            runs.append({**where, **shape, "num_prompts": r["seqs"] // copies,
                         "max_num_seqs": r["batch"] * r["replicas"] // copies,
                         "max_num_batched_tokens": r["max_num_batched_tokens"],
                         "tok_s": round(r["whole_tok_s"] / copies, 1), "includes_prefill": True})
    return runs


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (nothing for None)."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)


def merge(payloads: list[dict]) -> dict:
    """One payload of several runs' payloads (each layout in a process of its own, so a
    layout that hangs costs only its own time limit): rows and failures concatenated, the
    first payload's conditions. ValueError if the runs measured different models or cases."""
    first = dict(payloads[0], rows=[], failed={})
    for p in payloads:
        if (p["model"], p["output_len"], p["cases"], p["batch_is"]) != \
                (first["model"], first["output_len"], first["cases"], first["batch_is"]):
            raise ValueError("merge: the files measured different models, cases or output lengths")
        first["rows"] += p["rows"]
        first["failed"].update(p["failed"])
    return first


def measurements_file(payload: dict) -> dict:
    """The planner's measurement file of a run's payload (planner/measurements.py)."""
    from megaserve.bench.devices import catalog_gpu
    from megaserve.bench.profile_out import planner_model

    preset, layers = planner_model(payload["model"])
    return {"format": "megaserve-measurements/1", "gpu": catalog_gpu(payload["device"]) or payload["device"],
            "device": payload["device"], "model": preset, "num_layers": layers, "dtype": payload["dtype"],
            "source": {"command": "megaserve bench device-layouts", "commit": payload["tree"],
                       "what": "steady decode (batch, step_ms) and whole workloads (includes_prefill)",
                       # the KV pool per engine: the planner replays preemption where it runs out
                       "kv_cache_memory_bytes": payload.get("kv_cache_memory_bytes")},
            "runs": measurement_runs(payload["rows"])}


def print_table(payload: dict) -> None:
    rows = payload["rows"]
    print(f"device: {payload['device']} x {payload['gpus_visible']}  model: {payload['model']} "
          f"{payload['dtype']}  out {payload['output_len']}, greedy; baseline {payload['baseline']}")
    print(f"{'layout':<10} {'case':>9} {'GPUs':>4} {'ms/step':>8} {'tok/s/GPU':>9} {'vs base':>8} "
          f"{'whole tok/s/GPU':>15} {'vs base':>8} {'gc ms':>6}")
    key = (lambda r: (r["input_len"], r["seqs"])) if payload["batch_is"] == "total" else \
        (lambda r: (r["input_len"], r["batch"]))
    base = {key(r): r for r in rows if r["layout"] == payload["baseline"]}
    for r in rows:
        b = base.get(key(r))
        ratio = f"{r['tok_s_gpu'] / b['tok_s_gpu']:.2f}x" if b else "-"
        whole_gpu = r.get("whole_tok_s_gpu")
        whole_ratio = (f"{whole_gpu / b['whole_tok_s_gpu']:.2f}x"
                       if whole_gpu and b and b.get("whole_tok_s_gpu") else "-")
        print(f"{r['layout']:<10} {r['input_len']:>4}x{r['batch']:<4} {r['gpus']:>4} {r['ms_step']:>8.2f} "
              f"{r['tok_s_gpu']:>9.0f} {ratio:>8} {whole_gpu or 0:>15.0f} {whole_ratio:>8} "
              f"{r.get('gc_ms', float('nan')):>6.1f}")
    for name, why in payload["failed"].items():
        print(f"{name}: FAILED {why}")
