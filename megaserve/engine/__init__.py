"""Engine: requests, paged KV cache, continuous-batching scheduler, sampler, model runner."""
