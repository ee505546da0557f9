"""M:N transport: one-sided write-with-immediate channels (inproc, tcp, cuda_ipc, rdma) and an NCCL baseline."""
