"""Transports: how a packet's bytes and the acks cross between processes.

Every transport has the same shape (see ``_base``): a shared part written once
per send, one sender-side channel per worker, and one worker-side endpoint.
"""
