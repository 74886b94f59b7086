"""Short seeded chaos runs across emulated hosts (the torch.distributed
scheme with and without deltas, Ray's relay with deltas): hosts killed
and restarted, links cut and healed, hosts stopped, links slowed tenfold
and the trainer interrupted, while the trainer sends back to back.
``weightsync.bench._chaos_hosts`` says what must hold; the long soak is
``python benchmarks/chaos_soak.py``.

Replay a failure with its seed: ``WEIGHTSYNC_CHAOS_SEED=<seed> pytest -m
cluster tests/test_chaos_hosts.py``.
"""

from __future__ import annotations

import os

import pytest

from weightsync.bench import ChaosConfig, emulation_unavailable_reason, run_chaos
from weightsync.bench import chaos_schedule as schedule

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        emulation_unavailable_reason() is not None, reason=str(emulation_unavailable_reason())
    ),
]

SEED = int(os.environ.get("WEIGHTSYNC_CHAOS_SEED", "3"))


def test_the_schedule_is_the_seeds() -> None:
    one = schedule(SEED, 3, 300.0, 5.0)
    assert one == schedule(SEED, 3, 300.0, 5.0)
    assert one != schedule(SEED + 1, 3, 300.0, 5.0)
    assert {f.kind for f in one} == {"kill", "cut", "stop", "slow", "interrupt"}
    # At most two hosts faulted at once, never one host twice.
    for fault in one:
        if fault.kind == "interrupt":
            continue
        overlapping = [
            f for f in one if f.kind != "interrupt" and f.at <= fault.at < f.at + f.seconds and f is not fault
        ]
        assert len(overlapping) < 2 and all(f.host != fault.host for f in overlapping)


@pytest.mark.parametrize(
    ("scheme", "delta"),
    [("distributed", False), ("distributed", True), ("ray", True)],
    ids=["distributed", "distributed-delta", "ray-relay-delta"],
)
def test_sends_under_chaos_across_hosts(scheme: str, delta: bool) -> None:
    """About two minutes each: 16 MiB sends with a 6 s deadline, a fault
    every 4 s on average. Every rule of the soak holds; faults of several
    kinds happened. A host that missed versions costs at most the full
    bytes once more; with deltas, only a fraction of them."""
    if scheme == "ray":
        pytest.importorskip("ray")
    if delta:
        pytest.importorskip("blosc2")
    # About 100 s of chaos each: deltas of 1% of 16 MiB take a tenth of the full sends' time.
    sends = {("distributed", False): 220, ("distributed", True): 1300, ("ray", True): 900}[scheme, delta]
    config = ChaosConfig(
        hosts=3, mib=16, sends=sends, calm=10, timeout=6.0, seed=SEED, gap=4.0, missed=(1, 5), delta=delta,
        scheme=scheme,
    )  # fmt: skip
    result = run_chaos(config)
    figures = result["figures"]
    context = f"seed {SEED}: {figures}"
    assert result["problems"] == [], f"{context}\n" + "\n".join(result["problems"])
    assert figures["sends"] >= config.sends, context
    applied = figures["faults"]
    assert sum(applied.values()) >= 5, context
    # A send far past its deadline would have been a problem; none came close.
    assert figures["worst_past_deadline_s"] < 3.0, context
    assert figures["worst_stage_s"] < 2.0, context
    missed = figures["missed_versions"]
    assert missed["kept_up"]["ok"] and missed["missed_5"]["ok"], context
    assert missed["missed_5"]["wire"] <= 2 * figures["full_bytes"], context
    if delta:
        # Five versions of 1% of the elements each: a delta against the version it holds.
        assert missed["missed_5"]["delta"] == [True, True], context
        assert 0 < missed["missed_5"]["host_wire"] < 0.5 * figures["full_bytes"], context
