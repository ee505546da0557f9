"""One client cannot freeze the server: a storm of huge prompts while ``/health`` is probed.

The storm runs in a child process (its sending threads would otherwise compete with the
probing thread for this process's interpreter lock) and the probes are timed here, one
connection each, as a kubelet probes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from .conftest import http_get, ready_server

# 100 concurrent prompts, each too long for max_model_len = 4,096: half ~131 KB (the
# prompt the freeze was found with, now refused by the size bound before tokenizing),
# half ~52 KB (within that bound: tokenized, ~26,000 tokens, then refused).
_STORM = r"""
import json, sys, threading, urllib.request, urllib.error
url, n = sys.argv[1], int(sys.argv[2])
bodies = [json.dumps({"prompt": "ab c" * repeat, "max_tokens": 1}).encode()
          for repeat in map(int, sys.argv[3:])]
codes = []
def send(body):
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            codes.append(r.status)
    except urllib.error.HTTPError as e:
        codes.append(e.code)
    except OSError:
        codes.append(-1)
threads = [threading.Thread(target=send, args=(bodies[i % len(bodies)],))
           for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(codes))
"""

HEALTH_BOUND_S = 0.1  # the bound on /health while the storm runs
WORST_S = 2.0  # no probe near the old freeze (a kubelet probe's default timeout is 1 s)


def _probe_while(running: threading.Event, url: str, latencies: list[float]) -> None:
    while running.is_set():
        started = time.perf_counter()
        try:
            ok = http_get(url + "/health", timeout=10)[0] == 200
        except OSError:  # timed out or refused: counted as never answered
            ok = False
        latencies.append(time.perf_counter() - started if ok else float("inf"))
        time.sleep(0.01)


def test_health_answers_during_a_storm_of_huge_prompts(model_cache, tmp_path):
    with ready_server(tmp_path / "server.log", model_cache, "--dtype", "float32",
                      "--max-num-seqs", "16", "--max-waiting", "256",
                      "--max-model-len", "4096") as srv:
        latencies: list[float] = []
        running = threading.Event()
        running.set()
        prober = threading.Thread(target=_probe_while, args=(running, srv.url, latencies))
        storm = subprocess.Popen([sys.executable, "-c", _STORM, srv.url, "100", "32767", "13000"],
                                 stdout=subprocess.PIPE, text=True)
        prober.start()
        try:
            out, _ = storm.communicate(timeout=300)
        finally:
            running.clear()
            prober.join()
        codes = json.loads(out)
        # Every huge prompt is refused as too long (never a 5xx, never a dropped connection).
        assert codes == [400] * 100, codes
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        # Before the fix every probe during the storm waited 7.5-11 s. On a loaded CI
        # machine (measured here at load average 10 on 2 cores: p99 209 ms, 98% within
        # 100 ms) a probe can lose its core to other processes, so the bound is on the
        # fraction: at least 90% of probes within the 100 ms, none over 2 s.
        within = sum(x < HEALTH_BOUND_S for x in latencies) / len(latencies)
        assert len(latencies) >= 5, latencies
        assert within >= 0.9, f"p99 {p99 * 1e3:.0f} ms, {within:.0%} within 100 ms: {latencies}"
        assert latencies[-1] < WORST_S, latencies
        assert http_get(srv.url + "/health")[0] == 200


def test_size_bound_never_refuses_a_prompt_that_fits(model_cache):
    """``max_chars_per_token`` is a true bound: no text has fewer tokens than its length
    over the bound (else a prompt that fits would be refused without tokenizing)."""
    import random

    from megaserve.models.builtin import resolve_model
    from megaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model("builtin:tiny-moe"))
    bound = tok.max_chars_per_token
    vocab = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    longest = max(vocab, key=len)
    rng = random.Random(0)
    texts = [longest * 50, "ab c" * 5000, "你好, wörld! " * 300, " " * 10000,
             "".join(rng.choice(vocab) for _ in range(3000))]
    for text in texts:
        assert len(tok.encode(text)) * bound >= len(text), (bound, text[:40])
