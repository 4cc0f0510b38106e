"""The layers import in one direction: errors <- tree <- core <- {inference, training} <- apps, and no module
imports another that imports it back. Every import counts, those inside functions too."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each layer may import (besides the standard library and third-party packages).
ALLOWED = {
    "errors": {"errors"},
    "tree": {"errors", "tree"},
    "core": {"errors", "core"},
    "inference": {"errors", "tree", "core", "inference"},
    "training": {"errors", "tree", "core", "training"},
    "apps": {"errors", "tree", "core", "inference", "training", "apps"},
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "medusa_heads":
        raise ValueError(module)
    if len(parts) == 1:
        return "core"  # the package's lazy public API
    return {"errors": "errors", "tree": "tree", "inference": "inference", "training": "training",
            "apps": "apps"}.get(parts[1], "core")


def project_sources() -> dict[str, tuple[str, bool]]:
    """Module name -> (source, is a package), for every .py file the project installs (pyproject's package-dir)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    sources = {}
    for package, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT / folder).with_suffix("").parts
            if package == "medusa_heads" and relative[0] in ("tree", "inference", "training", "configs"):
                continue
            is_package = relative[-1] == "__init__"
            name = ".".join((package,) + (relative[:-1] if is_package else relative))
            sources.setdefault(name, (path.read_text(), is_package))
    return sources


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules `module` imports (absolute or relative, at any depth of the code)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from package import submodule` imports the submodule
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a non-module attribute: its module
                name = name.rpartition(".")[0]
            if name.startswith("medusa_heads"):
                found.add(name)
    return found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    known = set(sources)
    return {m: imports_of(m, src, pkg, known) - {m} for m, (src, pkg) in sources.items()}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})"
                  for m, targets in graph.items() for t in targets if layer(t) not in ALLOWED[layer(m)])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that is on one (depth-first search)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_layers_import_in_one_direction():
    assert layer_violations(import_graph(project_sources())) == []


def test_no_module_imports_another_back():
    assert cycles(import_graph(project_sources())) == []


def test_the_checks_catch_a_forbidden_import_and_a_cycle():
    sources = project_sources()
    generate, is_package = sources["medusa_heads.inference.generate"]
    sources["medusa_heads.inference.generate"] = (
        generate + "\n\ndef f():\n    from medusa_heads.training.data import tokenize_row\n", is_package)
    assert layer_violations(import_graph(sources)) == [
        "medusa_heads.inference.generate (inference) imports medusa_heads.training.data (training)"]
    drafter, is_package = sources["medusa_heads.inference.drafters.heads"]
    sources["medusa_heads.inference.drafters.heads"] = (drafter + "\nfrom ..registry import DRAFTERS\n", is_package)
    assert any("medusa_heads.inference.registry" in c and "medusa_heads.inference.drafters.heads" in c
               for c in cycles(import_graph(sources)))


def test_tree_needs_no_transformers_and_the_runtime_no_trainer():
    code = ("import sys, medusa_heads.tree, medusa_heads.tree.optimize; "
            "assert 'transformers' not in sys.modules, 'tree'; "
            "import medusa_heads.inference, medusa_heads.apps.cli; "
            "bad = [m for m in sys.modules if m.startswith(('medusa_heads.training', 'deepspeed'))]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_first_run_writes_the_model_cache_without_deepspeed(tmp_path):
    """Importing the CLI, the server and the runtime, and writing the model cache as the first `generate` does
    (`save_pretrained` imports DeepSpeed through accelerate, which prints its accelerator warning), imports no
    DeepSpeed; the cache holds what `save_pretrained` writes."""
    code = ("import sys, torch; from pathlib import Path; "
            "from transformers import LlamaConfig, LlamaForCausalLM; "
            "import medusa_heads.apps.cli, medusa_heads.apps.serve, medusa_heads.inference; "
            "from medusa_heads.backbone import _save_weights; "
            "torch.manual_seed(0); "
            "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, "
            "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)); "
            "_save_weights(model, Path(sys.argv[1])); "
            "assert 'deepspeed' not in sys.modules; "
            "model.save_pretrained(sys.argv[2])")
    ours, theirs = tmp_path / "ours", tmp_path / "save_pretrained"
    result = subprocess.run([sys.executable, "-c", code, str(ours), str(theirs)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for path in ours.iterdir():
        assert path.read_bytes() == (theirs / path.name).read_bytes(), path.name
