"""Diagnose the device plane over nccl across two GPUs: one request, a short timeout; on
failure print the relay's frame counters on the front-end and every thread's stack of both
processes (the expert process dumps on SIGUSR1)."""
import faulthandler
import os
import signal
import sys
import time

import torch

from megaserve import SamplingParams
from megaserve.engine.config import EngineConfig
from megaserve.runtime.device_engine import DevicePlaneEngine



def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    engine = DevicePlaneEngine(EngineConfig(model="builtin:tiny-moe", device="cuda", dtype="bfloat16",
                                            disaggregate=True, transport="nccl", microbatches=m,
                                            kv_cache_memory_bytes=1 << 28), timeout_s=20)
    print("started", flush=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("r0", "Hello", params)
    try:
        for i in range(10):
            t = time.time()
            outs = engine.step()
            print("step", i, "ok", round(time.time() - t, 3), [o.outputs[0].token_ids for o in outs],
                  "sent", engine.relay.frames_sent, "recv", engine.relay.frames_received, flush=True)
    except Exception as e:  # noqa: BLE001
        print("FAILED", type(e).__name__, e, flush=True)
        print("relay sent", engine.relay.frames_sent, "recv", engine.relay.frames_received,
              "error", engine.relay.error, flush=True)
        print("front flags out", [engine.relay.outgoing.flag_value(i) for i in range(engine.relay.outgoing.n)],
              "in", [engine.relay.incoming.flag_value(i) for i in range(engine.relay.incoming.n)], flush=True)
        for p in engine._processes:
            os.kill(p.pid, signal.SIGUSR1)
        faulthandler.dump_traceback(all_threads=True)
        time.sleep(2)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
