"""A sharded trainer's model (DTensors: FSDP2's ``fully_shard``) is never
read as whole tensors: the torch.distributed scheme takes it (each rank
sends its own part), and every other scheme that reads weights refuses
it, at ``init_on_sender`` (or ``init_on_worker``, or the send that is
given such weights), with an error that names the sharded tensors and
says what to do; none crashes the trainer. Two real gloo ranks, uneven
shards."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness.programs import TESTS_DIR, program

pytest.importorskip("torch.distributed.fsdp")


@pytest.mark.extended  # (a torch.distributed job of 7 s)
def test_every_scheme_refuses_a_sharded_model_or_takes_it_and_none_crashes(tmp_path: Path) -> None:
    done = subprocess.run(
        program("sharded_trainer", str(tmp_path)), cwd=TESTS_DIR, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # weightsync reads each DTensor's layout (its rank's box of the
        # global tensor) from the mesh and placements alone, as torch holds it.
        assert results.pop("layouts") == [], results
        assert results.pop("none") == ["ok"]  # sends nothing: any model will do
        # The torch.distributed scheme takes it: every rank sends its own
        # part (a sender group, tests/test_sender_group.py); with no worker
        # there, every rank names the one that did not announce itself.
        kind, text = results.pop("distributed")
        assert kind == "AckTimeoutError" and "worker 0 (model 'policy') did not announce itself" in text, text
        for case, (kind, *message) in results.items():
            assert kind == "InvalidWeightsError", (rank, case, kind, message)
            text = message[0]
            side = "the worker's" if case == "a sharded worker" else "the trainer's"
            assert text.startswith(f"{side} weights of model 'policy' are sharded: "), (case, text)
            assert "0.weight" in text and "are DTensors" in text, (case, text)
            assert "(5, 7) over placements (Shard(dim=0),)" in text, (case, text)
            assert "t.full_tensor()" in text, (case, text)
