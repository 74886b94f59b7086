"""The RPC transport (``torch.distributed.rpc``): one call per worker and
send, carrying the whole packet as one flat tensor; its result is the ack."""
