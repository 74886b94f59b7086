"""The package keeps its layers: every module imports only modules of a
lower layer, the core never imports the benchmark, and nothing imports in a
circle. Read from the source with ``ast``, nested and lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "weightsync"

# Bottom to top; see docs/architecture.md. A module may import modules of
# lower layers only: not its own layer (so no transport leans on another),
# not a higher one.
LAYERS: list[set[str]] = [
    {"_exceptions", "_frames", "_transports._peer", "_exit"},
    {"_packet"},
    {"_memory._views", "_memory._placement"},
    {
        "_copy",
        "_plan",
        "_offload",
        "_loops",
        "_readiness",
        "_strategy",
        "_stepguard",
        "_torchrl",
    },
    {"_digest", "_memory._pinned", "_shards", "_reads"},
    # The memory layer: segments, slabs, page-locked buffers, placement.
    {"_memory._segment", "_delta"},
    {"_transports._chain._link", "_transports._chain._pipeline"},
    {"_transports._chain._gloo", "_memory._slab"},
    {"_memory"},
    # The chain the cross-host transports share, and what each family builds on it.
    {"_transports._chain._driver", "_transports._distributed._liveness", "_transports._ray._host_copy"},
    {"_transports._chain._delta_base"},
    {
        "_transports._chain",
        "_transports._base",
        "_transports._pipes._channel",
        "_transports._ray._relay",
        "_transports._distributed._protocol",
    },
    {
        "_transports._distributed._host_share",
        "_transports._distributed._host_group",
        "_transports._pipes._slot_ledger",
        "_transports._rpc._endpoint",
    },
    {
        "_transports._distributed._relay",
        "_transports._distributed._chain_control",
        "_transports._pipes._device_slots",
    },
    # One subpackage per transport family; a family never imports another.
    {
        "_transports._pipes._transport",
        "_transports._pipes._copy_staging",
        "_transports._pipes._slot_staging",
        "_transports._pipes._device_staging",
        "_transports._ray._transport",
        "_transports._none",
        "_transports._distributed._transport",
        "_transports._rpc._transport",
    },
    {
        "_transports",
        "_transports._distributed._group",
        "_transports._pipes",
        "_transports._ray",
        "_transports._distributed",
        "_transports._rpc",
    },
    {"_announce", "_targets", "_packing", "_model_targets"},
    {"_send"},
    {"_drive"},
    {"_sender", "_receiver", "_legacy", "_sender_group"},
    {"_runtime"},
    {"_facade"},
    {"schemes._base"},
    # A sharded trainer's collective sends, under the distributed scheme.
    {"schemes._group_send"},
    {"schemes._pipes", "schemes._ray", "schemes._none", "schemes._distributed", "schemes._rpc"},
    # A scheme built on another family's.
    {"schemes._ray_transform"},
    {"schemes"},
    {""},  # the package itself: re-exports the public names
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}
BENCH = "bench"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """The package's modules that ``path`` (module ``name``) imports, by name
    relative to the package ("" is the package itself)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and node.module.split(".")[0] == "weightsync":
                module = node.module.removeprefix("weightsync").lstrip(".")
            else:
                continue
            targets.append(module)
            targets.extend(f"{module}.{alias.name}".lstrip(".") for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "weightsync":
                    targets.append(alias.name.removeprefix("weightsync").lstrip("."))
        found.update(t for t in targets if t in MODULES)
    found.discard(name)
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: _imports(path, name) for name, path in MODULES.items()}


def _is_bench(name: str) -> bool:
    return name == BENCH or name.startswith(BENCH + ".")


def test_every_core_module_has_a_layer() -> None:
    unplaced = sorted(n for n in MODULES if not _is_bench(n) and n not in LAYER_OF and n != "__main__")
    assert not unplaced, f"add these modules to LAYERS (and docs/architecture.md): {unplaced}"


def test_modules_import_only_lower_layers() -> None:
    wrong = [
        f"{name} (layer {LAYER_OF[name]}) imports {dep} (layer {LAYER_OF.get(dep, 'bench')})"
        for name, deps in GRAPH.items()
        if name in LAYER_OF
        for dep in deps
        if _is_bench(dep) or LAYER_OF[dep] >= LAYER_OF[name]
    ]
    assert not wrong, "\n".join(wrong)


# Internals the bench measures on their own, by name: the delta codec.
BENCH_MAY_IMPORT = {"_delta"}


def test_the_bench_uses_only_the_public_package() -> None:
    wrong = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if _is_bench(name)
        for dep in deps
        if not (_is_bench(dep) or dep == "" or dep in BENCH_MAY_IMPORT)
    ]
    assert not wrong, "\n".join(wrong)


TESTS = Path(__file__).resolve().parent


def _bench_internals_in(source: str) -> list[str]:
    """The private names of ``weightsync.bench`` that ``source`` imports: a
    module ``weightsync.bench._x`` in any form, or an underscore name from
    the package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[:2] == ["weightsync", BENCH] and any(p.startswith("_") for p in parts[2:]):
                found.append(module)
    return found


def test_tests_use_only_the_public_names_of_the_bench() -> None:
    """The tests reach the bench (the emulated cluster, the trajectories)
    through ``weightsync.bench``'s exports, as scripts do: none imports its
    private modules."""
    wrong = [
        f"{path.relative_to(TESTS)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in _bench_internals_in(path.read_text())
    ]
    assert not wrong, "\n".join(wrong)


def test_the_bench_check_sees_a_private_import() -> None:
    source = (
        "import weightsync.bench._netns\n"
        "from weightsync.bench import _hosts, EmulatedCluster\n"
        "from weightsync.bench._trajectories import TRAJECTORIES\n"
        "from weightsync.bench import parse_rate\n"
    )
    assert _bench_internals_in(source) == [
        "weightsync.bench._netns",
        "weightsync.bench._hosts",
        "weightsync.bench._trajectories",
        "weightsync.bench._trajectories.TRAJECTORIES",
    ]


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if dep == "":  # importing the package from inside it is how submodules load
                continue
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_a_violation() -> None:
    """The graph is real: the facade's imports are found, and one of them
    would break the rules if the layers were the other way round."""
    assert {"_runtime", "_sender", "_receiver"} <= GRAPH["_facade"]
    assert "_transports._base" in GRAPH["_transports._pipes._transport"]
    assert LAYER_OF["_runtime"] > LAYER_OF["_transports._pipes._transport"]
