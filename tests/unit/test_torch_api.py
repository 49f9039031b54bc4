"""vdpcp calls only public torch API: a private module or attribute (torch.x._y) can vanish or change in any release
of the supported range (the shipped Qwen2.5-VL subject once imported torch.distributed._functional_collectives'
all_gather_single, which torch 2.11 lacks). The oldest-torch job (tox -e oldest-torch) runs the rest."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vdpcp"
# The one allowed, with why: `vdpcp bench harness` times torch's own MultiProcessTestCase, which lives there.
# Private names vdpcp relies on, each for a reason, each there across the declared range (2.6 to 2.14: the
# oldest-torch job runs the harness tests that use them):
ALLOWED = {
    ("tools/bench/harness.py", "torch.testing._internal.common_distributed"),  # the baseline the harness bench times
    # c10d's registry of live process groups: the only way to see every group a case made (its subgroups too)
    # and check them sound before its workers are kept (vdpcp.harness.soundness)
    ("harness/soundness.py", "torch.distributed.distributed_c10d._world"),
    # whether a forked child inherited an initialised CUDA (torch then refuses CUDA in it): the zygote's probe
    ("harness/zygote.py", "torch.cuda._is_in_bad_fork"),
    # the end of one backward pass, where a field-bug mutant gives torch.distributed back: torch has no public hook
    # for it (FSDP uses the same callback queue)
    ("tools/mutants/collectives.py", "torch.autograd.Variable._execution_engine"),
}


def _dotted(node, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([aliases.get(node.id, node.id), *reversed(parts)])
    return None


def private_torch_names(source: str) -> set[str]:
    """torch names in ``source`` (imports, attribute chains through import aliases, string imports) with a
    component starting with _."""
    tree, names, aliases = ast.parse(source), set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            aliases |= {alias.asname: alias.name for alias in node.names if alias.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
            aliases |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(_dotted(node, aliases) or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("torch."):
            names.add(node.value.split()[0])  # an import by name (importlib, a preload list)
    # dunder attributes (torch.__version__) are public
    return {n for n in names if n.split(".")[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in n.split("."))}


def test_the_package_uses_no_private_torch_api():
    found = {(str(path.relative_to(PACKAGE)), name) for path in sorted(PACKAGE.rglob("*.py"))
             for name in private_torch_names(path.read_text())}
    assert {f for f in found if not any(f[0] == a and f[1].startswith(b) for a, b in ALLOWED)} == set()


def test_the_check_sees_a_private_import_by_module_attribute_alias_or_name():
    assert private_torch_names("from torch.distributed._functional_collectives import all_gather_single") == {
        "torch.distributed._functional_collectives", "torch.distributed._functional_collectives.all_gather_single"}
    assert private_torch_names("import torch\nx = torch._dynamo.config") == {"torch._dynamo.config", "torch._dynamo"}
    assert private_torch_names("preload = ('torch._inductor.compile_fx',)") == {"torch._inductor.compile_fx"}
    assert private_torch_names("import torch.distributed as dist\ndist._coalescing_manager()") == {
        "torch.distributed._coalescing_manager"}
    assert private_torch_names("from torch import distributed\ndistributed._x") == {"torch.distributed._x"}
    assert private_torch_names("import torch\nprint(torch.__version__, torch.distributed.all_gather)") == set()
