"""Disaggregated runtime: attention workers and expert workers, composed over engines.

* :mod:`engine_client` — ``EngineClient``: the interface every engine-shaped class implements.
* :mod:`factory` — ``make_engine``: co-located, device data plane or host data plane.
* :mod:`layout` — which workers a layout runs (disaggregated, co-located expert
  parallelism, data parallelism), on which devices, as ``WorkerSpec``s.
* :mod:`async_engine` — ``AsyncLLMEngine``: any of them behind an asyncio stream API.
* :mod:`placement` — which expert worker holds which expert.
* :mod:`device_plane` — the GPU data plane: registered buffers, device-side packing and
  counts, stream flags, CUDA graphs for both roles (``DeviceExperts``, ``ExpertServer``).
* :mod:`device_engine` — ``DevicePlaneEngine``: one replica, expert workers as threads or
  cuda_ipc processes over the device data plane.
* :mod:`messages` — every typed message that crosses a process (front-end ↔ workers,
  AsyncLLMEngine ↔ its engine process).
* :mod:`frames` — the host data plane's dispatch / combine payloads.
* :mod:`remote_experts` — the attention side's ExpertClient over a comm endpoint.
* :mod:`expert_worker` — the expert side's serve loop (per-layer or lockstep aggregation).
* :mod:`workers` — worker entry points (attention, expert, both, or a whole engine) for
  threads and processes.
* :mod:`launcher`, :mod:`recovery` — starting workers (local or Ray) and replacing lost ones.
* :mod:`cluster` — ``DisaggregatedEngine``: the host data plane's front-end: launch,
  route, collect, shut down.
"""
