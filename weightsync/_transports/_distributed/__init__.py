"""The torch.distributed transport: bytes along the chain, control over
a TCPStore, liveness over one TCP connection per worker, one shared copy
per host."""
