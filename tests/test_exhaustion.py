"""Running out of descriptors or memory: a clear ResourceExhaustedError naming
the resource, nothing half-made left behind, the other side told, and the
next send works once the resource is back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from harness import Cluster, schemes

import weightsync as ws

# The trainer runs in a subprocess of its own, so that lowering its limits
# touches nothing else; the test itself plays its worker over a real pipe.
TRAINER = textwrap.dedent(
    """
    import multiprocessing as mp, os, resource, sys
    import torch
    import weightsync as ws
    from weightsync._packet import Manifest

    which = sys.argv[1]
    model = {"w": torch.randn(64 << 20 >> 2)}  # 64 MiB
    scheme = getattr(ws, which)(timeout=5)
    ours, theirs = mp.Pipe()
    scheme.init_on_sender("policy", pipes=[ours], model=model)
    theirs.send(("hello", "policy", os.getpid(), Manifest.of(model).signature, ("cpu",)))

    def memfds():
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        with open("/proc/self/maps") as maps:
            mapped = [line for line in maps if "memfd:weightsync" in line]
        return [t for t in out if "weightsync" in t] + mapped

    for limit in ("files", "memory"):
        kind = resource.RLIMIT_NOFILE if limit == "files" else resource.RLIMIT_AS
        saved = resource.getrlimit(kind)
        if limit == "files":
            resource.setrlimit(kind, (len(os.listdir("/proc/self/fd")) - 1, saved[1]))
        else:
            with open("/proc/self/status") as status:
                size = next(int(l.split()[1]) for l in status if l.startswith("VmSize:")) * 1024
            resource.setrlimit(kind, (size + (16 << 20), saved[1]))
        try:
            scheme.send()
            print("no error")
        except ws.ResourceExhaustedError as exc:
            print("error", exc.resource, "|", exc)
        resource.setrlimit(kind, saved)
        print("left", memfds())
    # The resources are back: the next send works, and it is version 1.
    scheme.get_sender().send_async()
    message = theirs.recv()
    theirs.send(("ack", message[1], None))
    print("version", scheme.get_sender().wait_async().version)
    scheme.shutdown()
    """
)


# Both schemes stage through the same segment code; the second one runs
# with the slow tests only. A trainer interpreter of its own: the extended step.
@pytest.mark.parametrize(
    "which",
    [
        pytest.param("MultiProcessWeightSyncScheme", marks=pytest.mark.extended),
        pytest.param("SharedMemWeightSyncScheme", marks=pytest.mark.slow),
    ],
)
def test_the_trainer_out_of_a_resource_is_told_which_and_recovers(which: str) -> None:
    done = subprocess.run([sys.executable, "-c", TRAINER, which], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for resource, error, left in (("open files", lines[0], lines[1]), ("memory", lines[2], lines[3])):
        assert error.startswith(f"error {resource} |"), lines
        assert left == "left []", f"a half-made segment was left behind: {lines}"
    assert lines[4] == "version 1", "a failed send used up a version"


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_a_worker_out_of_descriptors_tells_the_sender_and_keeps_its_model(scheme_name: str) -> None:
    c = Cluster(scheme_name, ["net", "net"])
    try:
        before = c.state(1)["weights"]
        # Before the first send, so that worker 1 has a segment to map.
        assert c.command(1, "limit_files") == "ok"
        c.bump()
        with pytest.raises(ws.WorkerApplyError) as info:
            c.sender.send(timeout=10)
        assert info.value.worker_ids == (1,)
        assert "open files" in info.value.worker_message
        c.assert_has(0, c.expected())
        # (Its answers to the test need descriptors too: give them back first.)
        assert c.command(1, "unlimit_files") == "ok"
        errors = c.state(1)["errors"]
        assert errors and errors[0].startswith("ResourceExhaustedError"), errors
        assert all(torch.equal(c.state(1)["weights"][k], v) for k, v in before.items()), "touched"
    finally:
        c.close()


def test_torch_out_of_gpu_memory_is_a_resource_exhausted_error_that_says_so() -> None:
    """What torch raises when a GPU allocation fails (a slab, a worker's own
    copy of a slot) becomes weightsync's error naming the resource; any
    other error passes through as it was."""
    from weightsync._exceptions import out_of_resources

    slab = "allocate a staging slab of 1024 bytes on cuda:0"
    with pytest.raises(ws.ResourceExhaustedError) as info, out_of_resources(slab):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 KiB\nmore lines")
    assert info.value.resource == "GPU memory"
    message = str(info.value)
    assert "allocate a staging slab" in message and "out of GPU memory" in message
    assert "more lines" not in message
    with pytest.raises(RuntimeError, match="not a resource"), out_of_resources("anything"):
        raise RuntimeError("not a resource")
