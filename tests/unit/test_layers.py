"""The package's layering, read from the source with `ast` (nothing of manualpar is imported).

- Each top-level name under manualpar/ sits in a layer of LAYERS (lowest first) and imports only
  from its own layer or lower ones; a new module must be placed here deliberately.
- Inside manualpar/embeddings/, each name (a root module of the shared vocabulary or a
  sub-package) sits in a layer of EMBEDDINGS_LAYERS the same way; the package's __init__, its
  public API, may import anything.
- No import cycle between modules, counting imports made only for type checking too (a cycle
  of annotations is still two modules that cannot be read apart).
- Only manualpar/strategy/ calls torch.distributed's collectives (everything else goes through
  the strategy, which adds timeouts, error messages and the checks).

Imports count at run time: inside functions too, but not under `if TYPE_CHECKING:`. Importing
manualpar.a.b runs manualpar/a/__init__.py, so it counts as importing manualpar.a as well
(except the root manualpar/__init__.py, which may import anything and is left out).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "manualpar"
ROOT = "manualpar"

LAYERS = [
    # nn: layers built on torch alone; phase_times: the step recorder embeddings and loop share
    {"errors", "eager", "dtensors", "deprecated", "nn", "phase_times"},
    {"environment", "heap", "seed"},  # heap: glibc malloc thresholds, process-wide
    {"ownership", "meta", "checkpoint"},
    {"strategy", "module"},
    {"builders", "embeddings", "metrics"},
    {"data"},  # the readers: batches of embeddings' SparseFeatures; the loop may read them
    {"loop"},
    {"cli", "testing", "__main__"},
]
# manualpar/embeddings/, bottom up: the shared vocabulary at its root, then one concern each
EMBEDDINGS = "manualpar.embeddings"
EMBEDDINGS_LAYERS = [
    {
        "config",
        "dtype_names",
        "exchange_layout",
        "feature_checks",
        "features",
        "id_spaces",
        "kjt_form",
        "plan",
        "plan_text",
        "routes",
        "row_blocks",
        "variable_batch",
    },
    {"kernels"},
    {"ids"},
    {"modules"},
    {"storage"},
    {"optim"},
    {"planning", "step"},
    {"sharded"},
]
ALLOWED_COLLECTIVE_CALLERS = "manualpar/strategy/"
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
        "barrier",
        "send",
        "recv",
        "isend",
        "irecv",
        "gather",
        "scatter",
        "monitored_barrier",
    }
)


@dataclass(frozen=True)
class Source:
    """One module of the package: its dotted name, its path as shown in messages, its text."""

    name: str
    path: str
    text: str
    is_package: bool = False


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (after resolving `from x import y`)
    line: int


# ---- reading the package ------------------------------------------------------------------------
def read_package(directory: Path = PACKAGE) -> dict[str, Source]:
    """Every .py file under `directory`, by dotted module name."""
    sources = {}
    for path in sorted(directory.rglob("*.py")):
        parts = path.relative_to(directory.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        shown = path.relative_to(directory.parent).as_posix()
        sources[name] = Source(name, shown, path.read_text(), is_package)
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (their `else:` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(reversed(node.orelse))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _known(name: str, modules: Iterable[str]) -> str | None:
    """`name`, or the longest module prefix of it that exists (manualpar.a.Thing -> manualpar.a)."""
    known = set(modules)
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(source: Source, modules: Iterable[str], typing: bool = False) -> list[Import]:
    """The package's modules `source` imports at run time (absolute or relative imports); with
    `typing`, also those imported only under `if TYPE_CHECKING:`."""
    modules = set(modules)
    found = []
    package = source.name if source.is_package else source.name.rpartition(".")[0]
    tree = ast.parse(source.text, source.path)
    for node in ast.walk(tree) if typing else _runtime_nodes(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from manualpar.x import y` imports module manualpar.x.y when there is one
            names = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                for alias in node.names
            ]
        for name in names:
            if name == ROOT or name.startswith(ROOT + "."):
                target = _known(name, modules)
                if target is not None and target != source.name:
                    found.append(Import(source.name, target, node.lineno))
    return found


def with_packages(target: str) -> list[str]:
    """The modules importing `target` runs: its packages' __init__ (not the root's), then it."""
    parts = target.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def import_graph(sources: Mapping[str, Source], typing: bool = False) -> dict[str, set[str]]:
    """Module -> modules its import runs (package __init__ chains included; the root left out);
    with `typing`, type-checking imports count as well.

    A module's own packages were imported before it ran, so a sibling import does not run
    them again; importing one of them by name still counts."""
    graph: dict[str, set[str]] = {name: set() for name in sources if name != ROOT}
    for name, source in sources.items():
        if name == ROOT:
            continue
        already = set(with_packages(name))
        for found in imports_of(source, sources, typing):
            runs = {m for m in with_packages(found.target)[:-1] if m not in already}
            graph[name].update((runs | {found.target}) - {name})
    return graph


# ---- the three rules ----------------------------------------------------------------------------
def top_name(module: str) -> str:
    """The first name under manualpar: manualpar.strategy.collectives -> strategy."""
    return module.split(".")[1] if "." in module else ""


def layer_of(module: str, layers: list[set[str]]) -> int | None:
    if module == ROOT:
        return len(layers) - 1  # the top: it imports every layer below the command line
    for index, names in enumerate(layers):
        if top_name(module) in names:
            return index
    return None


def unplaced_modules(sources: Mapping[str, Source], layers: list[set[str]]) -> list[str]:
    """Top-level names under manualpar/ that no layer lists."""
    return sorted(
        {top_name(n) for n in sources if n != ROOT and layer_of(n, layers) is None},
    )


def layer_violations(sources: Mapping[str, Source], layers: list[set[str]]) -> list[str]:
    """Each import of a higher layer, as `manualpar/x.py imports manualpar.y (layer i -> j)`."""
    found = []
    for name, source in sources.items():
        if name == ROOT:
            continue
        low = layer_of(name, layers)
        for imported in imports_of(source, sources):
            high = layer_of(imported.target, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{source.path} imports {imported.target} (layer {low} -> {high})")
    return list(dict.fromkeys(found))


def sub_name(module: str, package: str) -> str | None:
    """The first name under `package`: manualpar.embeddings.step.exchange -> step; None for a
    module outside it or for the package itself."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def sublayer_violations(
    sources: Mapping[str, Source], package: str, layers: list[set[str]]
) -> list[str]:
    """Imports between the names under `package` against `layers` (lowest first), and names
    no layer lists; the package's own __init__ (its public API) is left out."""
    index = {name: i for i, names in enumerate(layers) for name in names}
    found = []
    for name, source in sources.items():
        low_name = sub_name(name, package)
        if low_name is None:
            continue
        if low_name not in index:
            found.append(f"{source.path}: {package}.{low_name} is in no layer")
            continue
        for imported in imports_of(source, sources):
            high_name = sub_name(imported.target, package)
            if high_name is None or high_name not in index:
                continue
            if index[high_name] > index[low_name]:
                found.append(
                    f"{source.path} imports {imported.target} "
                    f"({low_name}: layer {index[low_name]} -> {high_name}: {index[high_name]})"
                )
    return list(dict.fromkeys(found))


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        pending = [iter(sorted(graph[start]))]
        while pending:
            following = next(pending[-1], None)
            if following is None:
                pending.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif following in on_path:
                return [*path[path.index(following) :], following]
            elif following not in done and following in graph:
                path.append(following)
                on_path.add(following)
                pending.append(iter(sorted(graph[following])))
    return None


def collective_calls(sources: Mapping[str, Source]) -> list[tuple[str, int, str]]:
    """(path, line, call) of every call of a torch.distributed collective in `sources`."""
    found = []
    for source in sources.values():
        tree = ast.parse(source.text, source.path)
        modules = {"dist", "torch.distributed"}  # names that mean the torch.distributed module
        functions = set()  # collectives imported by name
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch":
                modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                functions |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in COLLECTIVES
                and ast.unparse(func.value) in modules
            ) or (isinstance(func, ast.Name) and func.id in functions):
                found.append((source.path, node.lineno, ast.unparse(func)))
    return found


def misplaced_collectives(sources: Mapping[str, Source]) -> list[str]:
    return [
        f"{path}:{line} calls {call}"
        for path, line, call in collective_calls(sources)
        if not path.startswith(ALLOWED_COLLECTIVE_CALLERS)
    ]


# ---- the package ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def package() -> dict[str, Source]:
    sources = read_package()
    assert f"{ROOT}.strategy.collectives" in sources, f"no manualpar package at {PACKAGE}"
    return sources


def test_every_module_has_a_layer(package: dict[str, Source]) -> None:
    unplaced = unplaced_modules(package, LAYERS)
    assert unplaced == [], (
        f"manualpar/{unplaced[0]} is in no layer: add it to LAYERS in {__file__}, at the "
        "lowest layer holding everything it imports"
    )


def test_modules_import_only_their_layer_or_lower_ones(package: dict[str, Source]) -> None:
    violations = layer_violations(package, LAYERS)
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_embeddings_sub_packages_import_only_their_layer_or_lower_ones(
    package: dict[str, Source],
) -> None:
    violations = sublayer_violations(package, EMBEDDINGS, EMBEDDINGS_LAYERS)
    assert not violations, (
        "manualpar/embeddings/ against EMBEDDINGS_LAYERS (place a new sub-package at the lowest "
        "layer holding everything it imports):\n" + "\n".join(violations)
    )


# manualpar/embeddings/sharded/, bottom up: the parts, the module both collections are (built
# from the parts), the two collections (siblings: neither imports the other), what takes them
SHARDED = "manualpar.embeddings.sharded"
SHARDED_LAYERS = [
    {"remap_at_owner"},  # the raw-id remap's at-owner path, below the remapper choosing it
    {"managed_collisions", "table_storage", "table_hooks"},
    {"batch_inputs"},
    {"lookup"},
    {"sharded_tables"},
    {"bag_collection", "sequence_collection"},
    {"ranked_table", "ranking_checks"},  # the ranking's table and checks
    {"ranking", "shard_embeddings"},
]


def test_the_sharded_parts_sit_below_the_collections(package: dict[str, Source]) -> None:
    violations = sublayer_violations(package, SHARDED, SHARDED_LAYERS)
    collections = {f"{SHARDED}.bag_collection", f"{SHARDED}.sequence_collection"}
    violations += [
        f"{package[name].path} imports {imported.target} (the collections compose the parts)"
        for name in sorted(collections)
        for imported in imports_of(package[name], package, typing=True)
        if imported.target in collections
    ]
    assert not violations, (
        "manualpar/embeddings/sharded/ against SHARDED_LAYERS (a change of inputs, blocks or "
        "checkpoints goes into a part, not a collection):\n" + "\n".join(violations)
    )


def test_no_import_cycle(package: dict[str, Source]) -> None:
    cycle = find_cycle(import_graph(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_counting_type_checking_imports(package: dict[str, Source]) -> None:
    cycle = find_cycle(import_graph(package, typing=True))
    assert cycle is None, "import cycle (some imports for type checking only): " + " -> ".join(
        cycle or []
    )


def test_only_the_strategy_calls_collectives(package: dict[str, Source]) -> None:
    misplaced = misplaced_collectives(package)
    assert not misplaced, "collectives outside manualpar/strategy/:\n" + "\n".join(misplaced)
    calls = collective_calls(package)
    assert any(path == "manualpar/strategy/collectives.py" for path, _, _ in calls), (
        "the scan found no collective call in the strategy itself"
    )


# ---- the checks find what they look for -------------------------------------------------------
SYNTHETIC = {
    "manualpar/__init__.py": "from manualpar.cli import main\n",
    "manualpar/errors.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from manualpar.loop import Trainer\n"  # typing only: neither layer nor cycle
        "import manualpar.seed\n"  # layer 0 -> 1
    ),
    "manualpar/seed.py": "import torch\n",
    "manualpar/strategy/__init__.py": "from manualpar.strategy.core import Strategy\n",
    "manualpar/strategy/core.py": (
        "import torch.distributed as dist\n"
        "def f(x):\n"
        "    dist.all_reduce(x)\n"  # allowed here
        "    from manualpar.builders import ddp\n"  # layer 3 -> 4, at run time
    ),
    "manualpar/builders/__init__.py": "from .ddp import ddp\n",
    "manualpar/builders/ddp.py": (
        "import torch.distributed as dist\n"
        "from torch.distributed import broadcast as send_all\n"
        "from manualpar.strategy import core\n"
        "def ddp(x):\n"
        "    dist.barrier()\n"
        "    send_all(x, 0)\n"
        "    torch.distributed.all_gather([], x)\n"
    ),
    "manualpar/plugins.py": "from manualpar import errors\n",
}


@pytest.fixture
def synthetic() -> dict[str, Source]:
    sources = {}
    for path, text in SYNTHETIC.items():
        parts = Path(path).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        sources[name] = Source(name, path, text, is_package)
    return sources


def test_the_checks_report_each_kind_of_violation(synthetic: dict[str, Source]) -> None:
    assert unplaced_modules(synthetic, LAYERS) == ["plugins"]
    assert layer_violations(synthetic, LAYERS) == [
        "manualpar/errors.py imports manualpar.seed (layer 0 -> 1)",
        "manualpar/strategy/core.py imports manualpar.builders.ddp (layer 3 -> 4)",
    ]
    # builders.ddp -> strategy (its __init__) -> strategy.core -> builders (__init__) -> ddp
    assert find_cycle(import_graph(synthetic)) == [
        "manualpar.builders",
        "manualpar.builders.ddp",
        "manualpar.strategy",
        "manualpar.strategy.core",
        "manualpar.builders",
    ]
    assert misplaced_collectives(synthetic) == [
        "manualpar/builders/ddp.py:5 calls dist.barrier",
        "manualpar/builders/ddp.py:6 calls send_all",
        "manualpar/builders/ddp.py:7 calls torch.distributed.all_gather",
    ]


def test_typing_only_imports_and_lazy_imports_are_told_apart() -> None:
    lazy = Source(
        "manualpar.meta",
        "manualpar/meta.py",
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from manualpar.strategy import Strategy\n"
        "else:\n"
        "    from manualpar.errors import BuilderError\n"
        "def materialize():\n"
        "    from manualpar.loop.trainer import Trainer\n",
    )
    modules = {"manualpar.strategy", "manualpar.errors", "manualpar.loop", "manualpar.loop.trainer"}
    assert [(i.target, i.line) for i in imports_of(lazy, [*modules, lazy.name])] == [
        ("manualpar.errors", 5),
        ("manualpar.loop.trainer", 7),
    ]
    assert with_packages("manualpar.loop.trainer") == ["manualpar.loop", "manualpar.loop.trainer"]


def test_the_embeddings_check_reports_upward_and_unplaced_sub_packages() -> None:
    texts = {
        "manualpar.embeddings": ("manualpar/embeddings/__init__.py", "from .sharded import x\n"),
        "manualpar.embeddings.config": ("manualpar/embeddings/config.py", ""),
        "manualpar.embeddings.kernels": ("manualpar/embeddings/kernels/__init__.py", ""),
        "manualpar.embeddings.kernels.bags": (
            "manualpar/embeddings/kernels/bags.py",
            "from manualpar.embeddings.config import BUILDER\n"  # downward: fine
            "from manualpar.embeddings.step.routing import Routing\n",  # upward
        ),
        "manualpar.embeddings.step": ("manualpar/embeddings/step/__init__.py", ""),
        "manualpar.embeddings.step.routing": ("manualpar/embeddings/step/routing.py", ""),
        "manualpar.embeddings.extras": ("manualpar/embeddings/extras.py", ""),
    }
    sources = {
        name: Source(name, path, text, path.endswith("__init__.py"))
        for name, (path, text) in texts.items()
    }
    assert sublayer_violations(sources, EMBEDDINGS, EMBEDDINGS_LAYERS) == [
        "manualpar/embeddings/kernels/bags.py imports manualpar.embeddings.step.routing "
        "(kernels: layer 1 -> step: 6)",
        "manualpar/embeddings/extras.py: manualpar.embeddings.extras is in no layer",
    ]


# ---- loop/, cli/ and examples/ use public names only ------------------------------------------
# Public, by rule (manualpar/__init__.py and docs/gen_api.py): these modules and every module a
# public module's __all__ names (manualpar.embeddings.planning, manualpar.data, ...).
PUBLIC_ROOTS = (  # as docs/gen_api.py's ROOTS
    "manualpar",
    "manualpar.embeddings",
    "manualpar.testing",
    "manualpar.cli.torchx_component",
)
EXAMPLES = PACKAGE.parent / "examples"
# (importing file, imported module): why it may reach below the public names, for now
KNOWN_INTERNAL = {
    **dict.fromkeys(
        [
            ("examples/benchmarks/bench_embedding_kernels.py", "manualpar.embeddings.kernels.bags"),
            (
                "examples/benchmarks/bench_embedding_kernels.py",
                "manualpar.embeddings.kernels.native",
            ),
            (
                "examples/benchmarks/bench_embedding_kernels.py",
                "manualpar.embeddings.kernels.row_memory",
            ),
            ("examples/benchmarks/bench_simd_levels.py", "manualpar.embeddings.kernels.native"),
            ("examples/benchmarks/bench_row_writes.py", "manualpar.embeddings.storage.row_file"),
            ("examples/benchmarks/bench_row_checksum.py", "manualpar.embeddings.storage.row_file"),
            ("examples/benchmarks/bench_disk_tier.py", "manualpar.embeddings.storage.disk_tier"),
            ("examples/benchmarks/disk_hit_bounds.py", "manualpar.embeddings.storage.row_cache"),
            ("examples/benchmarks/bench_wire_dtype.py", "manualpar.embeddings.step.wire"),
        ],
        "a benchmark of that internal piece itself (kernels, row files, the cache, wire dtypes)",
    ),
    ("examples/benchmarks/bench_init.py", "manualpar.embeddings.sharded.table_storage"): (
        "times the rows' first touch (its `_fill_block`) inside the init it measures whole"
    ),
    ("examples/benchmarks/bench_cost_model_ranks.py", "manualpar.cli.calibrate"): (
        "measures the links as `python -m manualpar calibrate` does; the command is the public form"
    ),
    ("examples/recsys/train.py", "manualpar.cli.plot"): (
        "draws the run's metrics as `python -m manualpar plot` does; the command is the public form"
    ),
}


def all_names(source: Source) -> set[str] | None:
    """The strings of a module's top-level `__all__ = [...]`, or None without one."""
    for node in ast.parse(source.text, source.path).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return None


def public_names(sources: Mapping[str, Source]) -> dict[str, set[str]]:
    """Public module -> its __all__: PUBLIC_ROOTS, then the modules their __all__s name."""
    public: dict[str, set[str]] = {}
    pending = [name for name in PUBLIC_ROOTS if name in sources]
    while pending:
        module = pending.pop()
        if module in public:
            continue
        public[module] = all_names(sources[module]) or set()
        pending += [f"{module}.{n}" for n in public[module] if f"{module}.{n}" in sources]
    return public


def outside_imports(source: Source, own: str) -> Iterable[tuple[str, str, int]]:
    """(module, name, line) of each `from manualpar... import name` and `import manualpar...`
    in `source` (name "" for the latter), leaving out its own package `own`."""
    for node in ast.walk(ast.parse(source.text, source.path)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == ROOT and not node.module.startswith(own):
                yield from ((node.module, a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ROOT + ".") and not alias.name.startswith(own):
                    yield alias.name, "", node.lineno


def private_imports(
    users: Mapping[str, Source], sources: Mapping[str, Source], only: str = ROOT
) -> list[str]:
    """Imports by `users` (path -> source) of names outside every public module's __all__,
    among the modules under `only`; a user's own top package is its own business."""
    public = public_names(sources)
    found = []
    for path, source in users.items():
        own = ".".join(source.name.split(".")[:2]) if source.name.startswith(ROOT) else "\0"
        for module, name, line in outside_imports(source, own):
            if not (module + ".").startswith(only + "."):
                continue
            if (path, module) in KNOWN_INTERNAL:
                continue
            if module in public and (not name or name in public[module]):
                continue
            found.append(f"{path}:{line} imports {module}{f'.{name}' if name else ''}")
    return found


def _users(sources: Mapping[str, Source]) -> dict[str, Source]:
    """loop/ and cli/ modules by path, and every example script."""
    users = {s.path: s for s in sources.values() if top_name(s.name) in ("loop", "cli")}
    for path in sorted(EXAMPLES.rglob("*.py")):
        shown = path.relative_to(PACKAGE.parent).as_posix()
        users[shown] = Source(shown.removesuffix(".py").replace("/", "."), shown, path.read_text())
    return users


def test_loop_and_cli_reach_the_embeddings_through_public_names(
    package: dict[str, Source],
) -> None:
    users = {p: s for p, s in _users(package).items() if p.startswith(f"{ROOT}/")}
    found = private_imports(users, package, only=EMBEDDINGS)
    assert not found, (
        "import these from manualpar.embeddings or manualpar.embeddings.planning (add the name "
        "to its __all__ if a user needs it too):\n" + "\n".join(found)
    )


def test_examples_import_only_public_names(package: dict[str, Source]) -> None:
    users = {p: s for p, s in _users(package).items() if p.startswith("examples/")}
    assert users, f"no examples under {EXAMPLES}"
    found = private_imports(users, package)
    assert not found, (
        "examples show the public API: import these from manualpar, manualpar.embeddings, "
        "manualpar.embeddings.planning, manualpar.data, ... (their __all__):\n" + "\n".join(found)
    )


def test_known_internal_imports_are_still_made(package: dict[str, Source]) -> None:
    made = {
        (path, module)
        for path, source in _users(package).items()
        for module, _, _ in outside_imports(source, "\0")
    }
    assert set(KNOWN_INTERNAL) - made == set(), "KNOWN_INTERNAL entries that match nothing now"


def test_the_public_names_check_reports_internal_imports() -> None:
    texts = {
        "manualpar": ("manualpar/__init__.py", "__all__ = ['embeddings', 'Trainer']\n"),
        "manualpar.embeddings": (
            "manualpar/embeddings/__init__.py",
            "__all__ = ['row_wise', 'planning']\n",
        ),
        "manualpar.embeddings.planning": (
            "manualpar/embeddings/planning/__init__.py",
            "__all__ = ['plan_tables']\n",
        ),
        "manualpar.embeddings.plan": ("manualpar/embeddings/plan.py", "__all__ = ['on_disk']\n"),
        "manualpar.loop.trainer": (
            "manualpar/loop/trainer.py",
            "from manualpar.embeddings import row_wise\n"  # public
            "from manualpar.embeddings.planning import plan_tables\n"  # public
            "from manualpar.loop.data import batches\n"  # its own package
            "from manualpar.embeddings.plan import on_disk\n"  # internal module
            "from manualpar.embeddings import on_disk\n",  # not in the face's __all__
        ),
    }
    sources = {
        name: Source(name, path, text, path.endswith("__init__.py"))
        for name, (path, text) in texts.items()
    }
    users = {"manualpar/loop/trainer.py": sources["manualpar.loop.trainer"]}
    assert private_imports(users, sources, only=EMBEDDINGS) == [
        "manualpar/loop/trainer.py:4 imports manualpar.embeddings.plan.on_disk",
        "manualpar/loop/trainer.py:5 imports manualpar.embeddings.on_disk",
    ]


# ---- planning/ in stages ------------------------------------------------------------------------
PLANNING = "manualpar.embeddings.planning"
# the planner's stages, bottom up: the problem it is given, candidates, prices, the search under
# the constraints, explain, and the entry points that run them in order
PLANNING_LAYERS = [
    {"topology", "constraints", "workload", "popularity", "exchange_bytes"},
    {"candidates"},
    {"rank_costs", "block_costs", "cost_model", "price_cache"},
    {"plan_score", "fit_errors", "remapper_budget", "disk_budget", "memory_planner", "search"},
    {"wire_choice"},  # per collection, after the search's placements
    {"plan_notes", "cost_text"},
    {"cost_planner", "planner", "collection_plans"},
]


def test_the_planner_stages_import_only_their_stage_or_earlier_ones(
    package: dict[str, Source],
) -> None:
    violations = sublayer_violations(package, PLANNING, PLANNING_LAYERS)
    assert not violations, (
        "manualpar/embeddings/planning/ against PLANNING_LAYERS (candidates -> prices -> search "
        "-> explain):\n" + "\n".join(violations)
    )


def test_planning_prices_bytes_without_the_step(package: dict[str, Source]) -> None:
    """The planner prices a step from the exchange's description (exchange_layout.py, routes.py)
    and tiers through storage's interface, never from step/ or a tier class."""
    found = [
        f"{source.path} imports {imported.target}"
        for name, source in package.items()
        if name.startswith(PLANNING + ".") or name == PLANNING
        for imported in imports_of(source, package, typing=True)
        if imported.target.startswith(f"{EMBEDDINGS}.step")
        or imported.target == f"{EMBEDDINGS}.storage.disk_tier"
    ]
    assert not found, "planning/ reaches into the step or a tier class:\n" + "\n".join(found)
