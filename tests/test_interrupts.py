"""Ctrl-C and cancellation during a send: the copy work stops (or is waited
for) before the interruption goes on, memory is never unmapped under a copy,
nothing is left behind, and the next send delivers exactly the new weights."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import threading
import time

import pytest
from harness import TESTS_DIR, Cluster, program, scheme_names, schemes


def _interrupt_a_trainer(scheme_names: list[str], rounds: int, mib: int, seed: int) -> None:
    chooser = random.Random(seed)
    argv = program(
        "interrupted_trainer",
        ",".join(scheme_names),
        str(rounds),
        str(mib),
        python_options=("-X", "faulthandler"),
    )
    trainer = subprocess.Popen(argv, cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    lines: list[str] = []

    def expect(prefix: str) -> None:
        line = trainer.stdout.readline().strip()  # type: ignore[union-attr]
        lines.append(line)
        assert line.startswith(prefix), f"expected {prefix!r}, got {lines} / {trainer.stderr.read()}"  # type: ignore[union-attr]

    try:
        for i in range(len(scheme_names)):
            if i:
                expect("next")
            expect("ready")
            for r in range(rounds):
                expect(f"sending {r}")
                # Anywhere from before the first send begins to deep into a later one.
                time.sleep(chooser.uniform(0.0, 0.3))
                trainer.send_signal(signal.SIGINT)
                expect(f"verified {r}")
        expect("sending final")
        time.sleep(chooser.uniform(0.0, 0.3))
        trainer.send_signal(signal.SIGINT)
        out, err = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    # Exited by the KeyboardInterrupt it was sent, never by a signal (SIGSEGV).
    assert trainer.returncode == 3, f"exit status {trainer.returncode}: {err[-3000:]}"
    report = json.loads(out.strip().splitlines()[-1].removeprefix("left "))
    assert report == {"mapped": [], "fds": [], "threads": [], "children": []}, report


@pytest.mark.extended  # a trainer process of its own, 3 rounds of 64 MiB per scheme: about 20 s
def test_ctrl_c_during_sends_is_a_keyboard_interrupt_and_the_next_send_is_exact() -> None:
    # Both pipe schemes, one after the other, in one trainer process.
    _interrupt_a_trainer(scheme_names(pipes=True), rounds=3, mib=64, seed=12)


@pytest.mark.slow
@pytest.mark.timeout(600)  # 80 rounds of 256 MiB per scheme: about 250 s on 2 cores
def test_ctrl_c_during_sends_many_times() -> None:
    _interrupt_a_trainer(scheme_names(pipes=True), rounds=80, mib=256, seed=34)


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "weightsync-copy"]


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_a_cancelled_send_has_stopped_copying_when_the_cancel_returns(scheme_name: str) -> None:
    c = Cluster(scheme_name, ["big", "big"], trainer_kind="big")
    try:
        sender = c.scheme.get_async_sender()

        async def cancel_sends() -> int:
            cancelled = 0
            for delay in (0.0, 0.001, 0.005, 0.01, 0.02, 0.05):
                c.bump()
                task = asyncio.get_running_loop().create_task(sender.send())
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled += 1
                assert not _copy_threads(), "a copy thread outlived its cancelled send"
            return cancelled

        assert asyncio.run(cancel_sends()) > 0
        c.bump(0.5)
        expected = c.expected()
        c.sender.send()
        for i in range(2):
            c.assert_has(i, expected)
    finally:
        c.close()


def test_a_copy_interrupted_by_keyboard_interrupt_waits_for_its_helpers() -> None:
    import torch

    from weightsync._copy import CopyPlan

    dst = [torch.zeros(8 << 20) for _ in range(4)]
    src = [torch.full((8 << 20,), float(i)) for i in range(4)]
    plan = CopyPlan(dst, src)
    main = threading.main_thread()
    assert threading.current_thread() is main

    def interrupt_soon() -> None:
        time.sleep(0.001)
        signal.pthread_kill(main.ident, signal.SIGINT)  # type: ignore[arg-type]

    interrupted = 0
    for _ in range(20):
        interrupter = threading.Thread(target=interrupt_soon)
        try:
            interrupter.start()
            plan.run(threads=4)
            # Its SIGINT is raised in here at the latest, however late a
            # loaded machine runs the interrupter.
            interrupter.join()
            time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted += 1
            assert not _copy_threads(), "a copy thread ran on after the KeyboardInterrupt"
        interrupter.join()
    assert interrupted
    plan.run(threads=4)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
