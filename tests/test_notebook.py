"""A notebook's cells, in a real Jupyter kernel (ipykernel).

IPython runs every cell inside a task of the kernel's event loop, so a
blocking call from a cell is made "inside a coroutine" as asyncio sees it.
A cell's own code may block (that is what a cell does), and the blocking
calls work there; an ``async def`` that the cell awaits is a coroutine
like any other, and a blocking call in it is refused with the coroutine to
await.
"""

from __future__ import annotations

import json
import queue
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.extended

manager = pytest.importorskip("jupyter_client.manager")
pytest.importorskip("ipykernel")


@pytest.fixture(scope="module")
def kernel() -> Iterator[Any]:
    km, client = manager.start_new_kernel(kernel_name="python3")
    try:
        yield client
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def run_cell(client: Any, code: str, timeout: float = 60) -> str:
    """Run ``code`` as one cell; what it printed (its error raises here)."""
    msg_id = client.execute(textwrap.dedent(code))
    out: list[str] = []
    while True:
        try:
            msg = client.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the cell did not finish within {timeout} s: {''.join(out)}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise AssertionError(f"{content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def test_a_notebook_cell_may_block_its_kernels_loop(kernel: Any) -> None:
    run_cell(
        kernel,
        """
        import asyncio, copy, json, threading
        import torch
        from torch import nn
        import weightsync as ws

        torch.manual_seed(0)
        policy = nn.Linear(8, 2)
        scheme = ws.InProcessWeightSyncScheme(timeout=30)
        scheme.init_on_sender("policy", model=policy, num_workers=1)
        worker_policy = nn.Linear(8, 2)
        stop = threading.Event()

        def worker():
            mine = copy.copy(scheme)
            mine.init_on_worker("policy", model=worker_policy, worker_idx=0)
            while not stop.is_set():
                mine.receive(timeout=0.05)
            mine.shutdown()

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        """,
    )
    # A sync cell: its code runs inside a task of the kernel's loop.
    printed = run_cell(
        kernel,
        """
        in_a_task = asyncio.current_task() is not None
        scheme.wait_for_workers(timeout=30)
        report = scheme.get_sender().send()
        same = torch.equal(worker_policy.weight, policy.weight)
        print(json.dumps({"in_a_task": in_a_task, "version": report.version, "same": same}))
        """,
    )
    assert json.loads(printed) == {"in_a_task": True, "version": 1, "same": True}
    # A cell with a top-level await is a coroutine of the cell itself: still the cell's code.
    printed = run_cell(
        kernel,
        """
        await asyncio.sleep(0)
        with torch.no_grad():
            policy.weight.add_(1.0)
        handle = scheme.get_sender().send_async()
        report = handle.wait()
        same = torch.equal(worker_policy.weight, policy.weight)
        print(json.dumps({"version": report.version, "same": same}))
        """,
    )
    assert json.loads(printed) == {"version": 2, "same": True}
    # An async def the cell awaits is a coroutine: refused, with what to await.
    printed = run_cell(
        kernel,
        """
        async def train():
            scheme.get_sender().send()

        try:
            await train()
        except ws.BlockingCallError as exc:
            print(json.dumps({"refused": str(exc)}))
        report = await scheme.get_async_sender().send()
        print(json.dumps({"version": report.version}))
        """,
    )
    refused, sent = (json.loads(line) for line in printed.splitlines())
    assert "inside the coroutine train()" in refused["refused"]
    assert "await scheme.get_async_sender().send(...)" in refused["refused"]
    assert sent == {"version": 3}
    run_cell(kernel, "stop.set(); thread.join(30); scheme.shutdown()")
