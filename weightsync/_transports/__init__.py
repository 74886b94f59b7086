"""Transports: how a packet's bytes and the acks cross between processes.

Every transport has the same shape (see ``_base``): a staging written once
per send (one blocking ``write``), one sender-side channel per worker, and
one worker-side endpoint. One subpackage per family: ``_pipes`` (the
multiprocess, shared and in-process schemes), ``_ray``, ``_distributed``
(torch.distributed), ``_rpc`` (torch.distributed.rpc), and ``_chain``, the pipelined chain of hosts that the
last two share; ``_none`` moves nothing. Beneath them all, the memory they
stage in (``weightsync._memory``).
"""
