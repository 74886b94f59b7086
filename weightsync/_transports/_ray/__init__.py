"""The Ray transport: one object-store put per send and one actor call
per worker; across hosts, a relay along the chain into each host's
shared memory."""
