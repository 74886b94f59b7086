#!/usr/bin/env bash
# Run torchrl's own weight-sync collector tests (test/test_collectors.py) with
# weightsync's schemes in place of torchrl's.
#
#   scripts/torchrl_collector_tests.sh TORCHRL_CHECKOUT [pytest args...]
#
# TORCHRL_CHECKOUT: a checkout (or `git archive`) of pytorch/rl holding test/
# (and pytest.ini) of the torchrl version installed in the environment.
# The environment: PYTHON (default: python) with torch, tensordict, torchrl,
# weightsync, pytest, pytest-timeout and gymnasium (TestPolicyFactory and the
# auto-wrap tests skip without gym) installed, e.g.
#   python3.11 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install \
#       torch==2.13.0 'tensordict<0.15' torchrl==0.14.1 'gymnasium>=1.0,<1.3' \
#       -e '/path/to/weightsync[torchrl-test]'
#   git --git-dir=rl.git archive 6e18e35b2 test pytest.ini | tar -x -C /tmp/rl
#   PYTHON=/tmp/trl-venv/bin/python scripts/torchrl_collector_tests.sh /tmp/rl
# Extra arguments go to pytest (a -k of their own replaces the selection).
#
# WS_SUBSTITUTE=0 runs the same selection with torchrl's own schemes.
#
# What is substituted, before test_collectors.py is imported: every concrete
# scheme of torchrl.weight_update that weightsync also has (the multiprocess,
# shared-memory, no-op, Ray and distributed ones; WS_SUBSTITUTE_NAMES=A,B to
# pick), in torchrl.weight_update (where test_collectors.py imports them from),
# in torchrl's backend registry (WeightSyncScheme.from_backend) and in every
# loaded torchrl module outside torchrl.weight_update that holds them (so the
# collectors' default schemes are weightsync's too). torchrl's WeightSyncScheme
# base and the schemes weightsync lacks (RPCWeightSyncScheme) stay torchrl's.
# The report header lists each substitution; collection fails if the test
# module still holds a torchrl class under a substituted name.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 TORCHRL_CHECKOUT [pytest args...]" >&2
    exit 2
fi
checkout=$(cd "$1" && pwd)
shift
PYTHON=${PYTHON:-python}
test_dir="$checkout/test"
[ -f "$test_dir/test_collectors.py" ] || { echo "no test/test_collectors.py in $checkout" >&2; exit 2; }

plugin_dir=$(mktemp -d)
trap 'rm -rf "$plugin_dir"' EXIT
cat > "$plugin_dir/ws_substitute.py" <<'PLUGIN'
"""pytest plugin: weightsync's schemes in place of torchrl's (WS_SUBSTITUTE=0: off)."""
from __future__ import annotations

import os
import sys

ENABLED = os.environ.get("WS_SUBSTITUTE", "1") != "0"
# Default: every concrete scheme of torchrl.weight_update that weightsync also has.
ONLY = [n for n in os.environ.get("WS_SUBSTITUTE_NAMES", "").split(",") if n]
NAMES: list[str] = []
_done: list[str] = []


def _names() -> list[str]:
    import torchrl.weight_update as twu
    import weightsync

    names = ONLY or [
        n for n in dir(twu) if n.endswith("WeightSyncScheme") and n != "WeightSyncScheme"
    ]
    return [n for n in names if hasattr(weightsync, n)]


def _substitute() -> None:
    import torchrl.collectors  # noqa: F401  (loads the collectors' modules)
    import torchrl.weight_update as twu
    import weightsync
    from torchrl.weight_update import weight_sync_schemes as wss

    weightsync.register_with_torchrl()
    NAMES.extend(_names())
    for name in NAMES:
        old = getattr(twu, name)
        new = getattr(weightsync, name)
        setattr(twu, name, new)
        _done.append(f"torchrl.weight_update.{name}")
        for key, cls in list(wss._WEIGHT_SYNC_SCHEMES.items()):
            if cls is old:
                wss._WEIGHT_SYNC_SCHEMES[key] = new
                _done.append(f"from_backend({key!r})")
        for modname, mod in list(sys.modules.items()):
            # torchrl's own scheme modules keep their classes (they subclass them).
            if not modname.startswith("torchrl.") or modname.startswith("torchrl.weight_update."):
                continue
            if getattr(mod, name, None) is old:
                setattr(mod, name, new)
                _done.append(f"{modname}.{name}")


def pytest_configure(config):
    if ENABLED:
        _substitute()


def pytest_report_header(config):
    if not ENABLED:
        return "weightsync substitution: OFF (torchrl's own schemes)"
    import weightsync

    return [f"weightsync substitution: ON ({weightsync.__file__})", *("  " + d for d in _done)]


def pytest_collection_modifyitems(session, config, items):
    if not ENABLED:
        return
    import weightsync

    for mod in {item.module for item in items if getattr(item, "module", None) is not None}:
        for name in NAMES:
            if hasattr(mod, name) and getattr(mod, name) is not getattr(weightsync, name):
                raise RuntimeError(f"{mod.__name__}.{name} is not weightsync's: substitution came too late")
PLUGIN

# The weight-sync tests: every test whose name or class names weights, updates,
# policy factories, policy versions or per-worker options, and the auto-wrap
# test that updates weights.
selection="weight or update or policy_factory or PolicyFactory or PolicyVersion or UpdateParams or per_worker or test_auto_wrap_modules"

cd "$test_dir"
export PYTHONPATH="$plugin_dir${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PYTHON" -m pytest -p ws_substitute test_collectors.py -k "$selection" \
    -p no:cacheprovider --timeout 300 -o xfail_strict=True "$@" || status=$?
exit "$status"
