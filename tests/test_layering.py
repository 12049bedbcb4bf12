"""The layering of the four packages, read from the source with `ast` (nothing is imported).
They install under one namespace (`prefixserve.router`, ...); below, modules go by their path in
the repository (`router.blocks`), and an import that skips the namespace is refused.
`router` knows nothing of `workers`, `cluster` or `bench`; `workers` uses only router's
protocol and index modules; `cluster` never imports `bench`; inside `bench` only the entry points
import the CLI; and no module-level imports form a cycle. Every failure names the edges
(`importer:line -> imported`). Imports at any depth count for the layering (a lazy import is
still a dependency); for cycles only what runs at import time counts (not function bodies, not
`if TYPE_CHECKING:` blocks). The torch-free check of the ingress is in test_api_imports.py."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "workers", "cluster", "bench")
NAMESPACE = "prefixserve"

# What `workers` may take from `router`: the block/event/request protocol (sampling settings,
# the request error, a LoRA adapter's place in the cache key and the report of a worker's
# adapter slots included), the index seam and the publisher that feeds it. Nothing of the
# routing policies or the Serve router.
WORKERS_MAY_IMPORT = {"router.adapter_slots", "router.adapters", "router.blocks",
                      "router.errors", "router.events", "router.index",
                      "router.index_stores", "router.publisher", "router.request",
                      "router.registry", "router.sampling_params", "router.secret_refs"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {
    module_name(path): path for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    at_import_time: bool  # module level, outside `if TYPE_CHECKING:`

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}"


def package(module: str) -> str:
    return module.split(".", 1)[0]


def project_module(name: str) -> str | None:
    """The project module a dotted name refers to: the longest prefix that is one."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def in_namespace(name: str) -> str | None:
    """`prefixserve.router.blocks` -> `router.blocks`; None for anything outside the project."""
    head, _, rest = name.partition(".")
    return rest if head == NAMESPACE and package(rest) in PACKAGES else None


class ImportCollector(ast.NodeVisitor):
    def __init__(self, source: str) -> None:
        self.source = source
        self.is_package = source in MODULES and MODULES[source].name == "__init__.py"
        self.lazy = 0  # inside a function body or an `if TYPE_CHECKING:` block
        self.edges: list[Edge] = []
        self.bare: list[Edge] = []  # `import router...`: outside the installed namespace

    def _add(self, target: str | None, node: ast.stmt) -> None:
        if target is not None and target != self.source:
            self.edges.append(Edge(self.source, target, node.lineno, self.lazy == 0))

    def _lazily(self, nodes: list[ast.AST]) -> None:
        self.lazy += 1
        for node in nodes:
            self.visit(node)
        self.lazy -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self._lazily(node.body)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._lazily([node.body])

    def visit_If(self, node: ast.If) -> None:
        if is_type_checking(node.test):
            self._lazily(node.body)
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _absolute(self, name: str, node: ast.stmt) -> str | None:
        if package(name) in PACKAGES:
            self.bare.append(Edge(self.source, name, node.lineno, self.lazy == 0))
        return in_namespace(name)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            name = self._absolute(alias.name, node)
            if name is not None:
                self._add(project_module(name), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # relative: from the importing module's package, up level - 1
            base = self.source.split(".")
            if not self.is_package:
                base.pop()
            base = base[:len(base) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = self._absolute(node.module or "", node) or ""
        if package(module) not in PACKAGES:
            return
        for alias in node.names:  # `from prefixserve.router import blocks`: router.blocks
            submodule = f"{module}.{alias.name}"
            self._add(submodule if submodule in MODULES else project_module(module), node)


def collect_edges(paths: list[Path]) -> tuple[list[Edge], list[Edge]]:
    """The project edges, and the imports that skip the namespace, of every source module."""
    edges, bare = [], []
    for name, path in MODULES.items():
        collector = ImportCollector(name)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        edges.extend(collector.edges)
        bare.extend(collector.bare)
    for path in paths:  # modules outside the packages (tests) only count for bare imports
        collector = ImportCollector("")
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        bare.extend(collector.bare)
    return edges, bare


EDGES, BARE = collect_edges(sorted((ROOT / "tests").glob("*.py")))


def offending(edges: list[Edge]) -> str:
    return "\n  " + "\n  ".join(map(str, edges))


def test_the_graph_is_read_at_every_depth() -> None:
    """Guards the checks below against passing on an empty or half-read graph."""
    assert {"router.blocks", "workers.engine", "cluster.app", "bench.cli"} <= set(MODULES)
    assert "workers.models.config" in MODULES  # subpackages too
    pairs = {(e.source, e.target): e for e in EDGES}
    assert pairs[("workers.kv_cache", "router.events")].at_import_time
    assert ("workers.engine_core", "router.blocks") in pairs  # `from ...router import blocks`
    # a function-level import
    assert not pairs[("bench.load.soak", "bench.load.launch")].at_import_time


def test_every_import_goes_through_the_prefixserve_namespace() -> None:
    """A bare `import router...` would load a second copy of a module (or nothing, installed)."""
    assert not BARE, f"import these as {NAMESPACE}.<name>:{offending(BARE)}"


def test_router_imports_nothing_from_workers_cluster_or_bench() -> None:
    bad = [e for e in EDGES if package(e.source) == "router"
           and package(e.target) in ("workers", "cluster", "bench")]
    assert not bad, f"router must not depend on the layers above it:{offending(bad)}"


def test_workers_use_only_routers_protocol_modules_and_never_cluster_or_bench() -> None:
    bad = [e for e in EDGES if package(e.source) == "workers" and (
        package(e.target) in ("cluster", "bench")
        or (package(e.target) == "router" and e.target not in WORKERS_MAY_IMPORT))]
    assert not bad, (f"workers may import only {sorted(WORKERS_MAY_IMPORT)} from router, "
                     f"and nothing from cluster or bench:{offending(bad)}")


def test_cluster_never_imports_bench() -> None:
    bad = [e for e in EDGES if package(e.source) == "cluster" and package(e.target) == "bench"]
    assert not bad, f"cluster must not depend on bench:{offending(bad)}"


def test_only_the_entry_points_import_the_bench_cli() -> None:
    bad = [e for e in EDGES
           if e.target == "bench.cli" and e.source not in ("bench.cli", "bench.__main__")]
    assert not bad, f"only bench.cli and bench.__main__ may import bench.cli:{offending(bad)}"


def find_cycle(edges: list[Edge]) -> list[Edge] | None:
    """One cycle of `edges` as the list of edges that close it, or None."""
    out: dict[str, list[Edge]] = {}
    for edge in edges:
        out.setdefault(edge.source, []).append(edge)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Edge] = []

    def visit(node: str) -> list[Edge] | None:
        state[node] = 1
        for edge in out.get(node, []):
            if state.get(edge.target) == 1:
                start = next(i for i, e in enumerate(path) if e.source == edge.target) \
                    if edge.target != node else len(path)
                return [*path[start:], edge]
            if edge.target not in state:
                path.append(edge)
                found = visit(edge.target)
                if found:
                    return found
                path.pop()
        state[node] = 2
        return None

    for node in sorted(out):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles_at_import_time() -> None:
    cycle = find_cycle([e for e in EDGES if e.at_import_time])
    assert cycle is None, f"module-level imports form a cycle:{offending(cycle or [])}"


def test_no_import_cycles_at_any_depth() -> None:
    """A lazy import that closes a circle still ties the two modules into one."""
    cycle = find_cycle(EDGES)
    assert cycle is None, f"imports form a cycle:{offending(cycle or [])}"


MAX_LINES = 400  # per source file of the product packages; bench/ holds scripts


def test_no_product_source_file_is_over_the_line_cap() -> None:
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()
             if package(name) in ("router", "workers", "cluster")}
    assert lines["router.blocks"] > 100  # read, not empty
    big = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines, split by job: {big}"


def test_find_cycle_names_each_edge_of_the_cycle() -> None:
    a_b, b_c, c_a, c_d = (Edge("a", "b", 1, True), Edge("b", "c", 2, True),
                          Edge("c", "a", 3, True), Edge("c", "d", 4, True))
    assert find_cycle([a_b, b_c, c_d]) is None
    assert find_cycle([c_d, a_b, b_c, c_a]) == [a_b, b_c, c_a]
    y_y = Edge("y", "y", 2, True)
    assert find_cycle([Edge("x", "y", 1, True), y_y]) == [y_y]
