"""The memory layer, beneath every transport: where a send's bytes
wait and how they get there. Host segments (``_segment``: memfd, the
publish/seqlock header), CUDA slabs shared by IPC (``_slab``),
page-locked host buffers and the chunked device-to-host copy
(``_pinned``), and where weights live and how a send reaches each worker
(``_placement``)."""
