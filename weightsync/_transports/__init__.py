"""Transports: how a packet's bytes and the acks cross between processes.

Every transport has the same shape (see ``_base``): a staging written once
per send, one sender-side channel per worker, and one worker-side endpoint.
One transport per file; a staging and its worker-side reader share a file.
"""
