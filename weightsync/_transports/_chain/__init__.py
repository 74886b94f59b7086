"""The chain both cross-host transports run on: one send's bytes along
a pipelined chain of members over gloo, repaired around members that
fail, and the trainer's delta base for a chain that carries deltas."""
