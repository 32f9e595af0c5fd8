"""Build the Hub-kernel repository of liger_kernel (the layout ``kernels`` 0.19 loads) into OUT_DIR.

Usage::

    python scripts/build_hub_kernel.py OUT_DIR [--backend cuda --backend cpu ...]

writes, for each backend, the pure-Triton (noarch) variant ``OUT_DIR/build/torch-<backend>/``:

* ``__init__.py`` (the package; ``from . import layers``) and ``layers.py``, from
  ``src/liger_kernel/hub/layers.py``;
* ``ops/<name>.py``: every ``liger_kernel.ops`` module in the import graph of the layers (computed
  from the source, so added or renamed ops modules follow), with ``liger_kernel.ops`` imports made
  relative, and the ``torch.library`` namespace ``liger`` of their custom ops renamed to the
  build's own (``liger_kernel`` itself can be imported in the same process);
* ``metadata.json``: ``id`` (``_liger_kernel_<source hash>_<backend>``, the ``sys.modules`` key),
  ``name`` ``liger-kernel``, ``version`` (``LAYERS_VERSION`` of the layers, the Hub branch
  ``v<version>``), ``license``, ``python-depends`` (none), ``backend.type`` and the sha256
  ``digest`` of the variant's files, which ``kernels`` verifies on every local load;

and ``OUT_DIR/README.md``, the repository card.

The bundle may import the standard library, torch, triton and itself only; anything else fails
the build. Backends: ``cuda`` and ``cpu`` by default (on a CPU the kernels run only under
``TRITON_INTERPRET=1``); ``rocm`` and ``xpu`` build the same files but are untested. Upload
``OUT_DIR`` to a Hub kernel repository (branch ``v<version>``) or load it as it is with
``kernels.LocalLayerRepository`` (see docs/ecosystem.md).
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import io
import json
import shutil
import sys
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "liger_kernel"
LAYERS_MODULE = "liger_kernel.hub.layers"
BUNDLED_PACKAGE = "liger_kernel.ops"  # the only part of liger_kernel a build may bundle
KERNEL_NAME = "liger-kernel"
LICENSE = "BSD-2-Clause"
BACKENDS = ("cuda", "rocm", "xpu", "cpu")
DEFAULT_BACKENDS = ("cuda", "cpu")
CUSTOM_OP_NAMESPACE = "liger"
ALLOWED_TOP_LEVEL = {"__future__", "torch", "triton"} | set(sys.stdlib_module_names)


class BuildError(RuntimeError):
    """The sources cannot be bundled into a kernel (an import outside what a kernel may use)."""


def module_path(module: str) -> Path:
    """The source file of ``liger_kernel`` module ``module`` (a package's ``__init__.py``)."""
    path = SRC.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def is_module(module: str) -> bool:
    path = SRC.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def bundle_name(module: str) -> str:
    """Where a source module lives in the kernel package: ``layers``, ``ops``, ``ops.<name>``."""
    if module == LAYERS_MODULE:
        return "layers"
    return module[len(PACKAGE) + 1:]


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if not module_path(module).name == "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def liger_imports(module: str, tree: ast.AST) -> list[tuple[ast.stmt, list[str]]]:
    """``(statement, [imported liger_kernel modules])`` for every import of ``liger_kernel`` in
    ``tree`` (anywhere, function bodies included); raises :class:`BuildError` for a name a kernel
    cannot import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(node, module)
            names = [origin] if origin.split(".")[0] != PACKAGE else [
                f"{origin}.{alias.name}" if is_module(f"{origin}.{alias.name}") else origin for alias in node.names]
            if origin == BUNDLED_PACKAGE and BUNDLED_PACKAGE in names:
                # The bundle's ops/__init__.py re-exports nothing.
                raise BuildError(f"{module}:{node.lineno}: import names from their {BUNDLED_PACKAGE} module, "
                                 f"not from {BUNDLED_PACKAGE} itself")
        else:
            continue
        targets = []
        for name in names:
            top = name.split(".")[0]
            if top == PACKAGE:
                if name != BUNDLED_PACKAGE and not name.startswith(BUNDLED_PACKAGE + "."):
                    raise BuildError(f"{module} imports {name}: a kernel may bundle only {BUNDLED_PACKAGE}")
                targets.append(name)
            elif top not in ALLOWED_TOP_LEVEL:
                raise BuildError(f"{module} imports {name}: a kernel may import only the standard library, "
                                 "torch, triton and itself")
        if targets:
            found.append((node, targets))
    return found


def import_closure(entry: str = LAYERS_MODULE) -> list[str]:
    """The ``liger_kernel`` modules ``entry`` needs, itself first, then sorted."""
    seen, stack = {entry}, [entry]
    while stack:
        module = stack.pop()
        tree = ast.parse(module_path(module).read_text())
        for _, targets in liger_imports(module, tree):
            for target in targets:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
    return [entry] + sorted(seen - {entry, BUNDLED_PACKAGE})


def _relative(importer: str, target: str) -> str:
    """The relative module name that imports bundle module ``target`` from bundle module ``importer``
    (``from <it> import ...``); bundle modules are ``layers``, ``ops``, ``ops.<name>``."""
    package = importer.split(".")[:-1]
    parts = target.split(".")
    common = 0
    while common < min(len(package), len(parts)) and package[common] == parts[common]:
        common += 1
    return "." * (len(package) - common + 1) + ".".join(parts[common:])


def _rewrite_imports(module: str, source: str) -> str:
    """``source`` with every ``liger_kernel.ops`` import made relative to the bundle."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    importer = bundle_name(module)
    edits = []
    for node, _ in liger_imports(module, tree):
        if isinstance(node, ast.ImportFrom):
            names = ", ".join(alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in node.names)
            statement = f"from {_relative(importer, bundle_name(_absolute(node, module)))} import {names}"
        else:
            statements = []
            for alias in node.names:
                if alias.name.split(".")[0] != PACKAGE:
                    statements.append(f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else ""))
                    continue
                parent, _, leaf = alias.name.rpartition(".")
                if alias.asname is None:
                    # `import liger_kernel.ops.x` binds the name `liger_kernel`, which a bundle cannot have.
                    raise BuildError(f"{module}:{node.lineno}: write `from {parent} import {leaf}` instead of "
                                     f"`import {alias.name}`")
                statements.append(f"from {_relative(importer, bundle_name(parent))} import {leaf} as {alias.asname}")
            statement = "; ".join(statements)
        first, last = node.lineno - 1, node.end_lineno - 1
        if lines[first][: node.col_offset].strip():
            raise BuildError(f"{module}:{node.lineno}: an import must start its line")
        edits.append((first, last, " " * node.col_offset + statement + lines[last][node.end_col_offset:]))
    for first, last, text in sorted(edits, reverse=True):
        lines[first: last + 1] = [text]
    return "".join(lines)


def _rename_custom_op_namespace(source: str, namespace: str) -> tuple[str, int]:
    """Replace ``liger::`` in the string literals of ``source`` (the ``torch.library`` op names)."""
    marker = f"{CUSTOM_OP_NAMESPACE}::"
    kinds = {tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())
    lines = source.splitlines(keepends=True)
    edits = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in kinds and marker in token.string:
            edits.append(token)
    for token in reversed(edits):
        (row, col), (end_row, end_col) = token.start, token.end
        if row != end_row:
            text = "".join(lines[row - 1:end_row])
            start = col
            end = len(text) - len(lines[end_row - 1]) + end_col
            new = text[:start] + text[start:end].replace(marker, f"{namespace}::") + text[end:]
            lines[row - 1:end_row] = [new]
        else:
            line = lines[row - 1]
            lines[row - 1] = line[:col] + line[col:end_col].replace(marker, f"{namespace}::") + line[end_col:]
    return "".join(lines), len(edits)


def check_bundle(files: dict[str, str]) -> None:
    """Every bundled file parses and neither imports nor names ``liger_kernel``."""
    for path, source in files.items():
        tree = ast.parse(source, filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
                raise BuildError(f"{path}:{node.lineno} still imports {PACKAGE}")
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == PACKAGE:
                raise BuildError(f"{path}:{node.lineno} still imports {PACKAGE}")
            if isinstance(node, ast.Name) and node.id == PACKAGE:
                raise BuildError(f"{path}:{node.lineno} uses the name {PACKAGE}")


def module_constant(module: str, name: str):
    """The literal value a module assigns to ``name`` at top level, read without importing it."""
    for node in ast.parse(module_path(module).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise BuildError(f"{module} assigns no {name}")


def bundle_sources() -> dict[str, str]:
    """``{relative path: source}`` of the kernel package, before the namespace rename."""
    files = {}
    for module in import_closure():
        files[bundle_name(module).replace(".", "/") + ".py"] = _rewrite_imports(module, module_path(module).read_text())
    files["ops/__init__.py"] = f'"""The {BUNDLED_PACKAGE} modules the layers need, bundled by scripts/build_hub_kernel.py."""\n'
    version = module_constant(PACKAGE, "__version__")
    files["__init__.py"] = (
        f'"""liger_kernel {version} as a Hub kernel: Triton kernels for LLM training.\n\n'
        'The layers ``kernels.kernelize`` binds are in :mod:`.layers`; built by scripts/build_hub_kernel.py.\n"""\n\n'
        "from . import layers\n\n__all__ = [\"layers\"]\n"
    )
    check_bundle(files)
    return files


def file_digest(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def build(out_dir: Path, backends: tuple[str, ...] = DEFAULT_BACKENDS) -> list[Path]:
    """Write ``out_dir/build/torch-<backend>/`` for each backend; returns the variant directories."""
    unknown = set(backends) - set(BACKENDS)
    if unknown or not backends:
        raise BuildError(f"backends must be some of {BACKENDS}, got {backends}")
    files = bundle_sources()
    version = int(module_constant(LAYERS_MODULE, "LAYERS_VERSION"))
    source_hash = hashlib.sha256(json.dumps([version, sorted(files.items())]).encode()).hexdigest()[:12]
    variants = []
    for backend in backends:
        kernel_id = f"_liger_kernel_{source_hash}_{backend}"
        namespace = kernel_id.lstrip("_")
        variant = out_dir / "build" / f"torch-{backend}"
        if variant.exists():
            shutil.rmtree(variant)
        renamed = {}
        registers_ops = False
        for path, source in files.items():
            renamed[path], count = _rename_custom_op_namespace(source, namespace)
            registers_ops |= count > 0
        if not registers_ops and any("torch.library" in source for source in files.values()):
            raise BuildError(f"no '{CUSTOM_OP_NAMESPACE}::' op name found to rename in the bundled sources")
        digests = {}
        for path, source in sorted(renamed.items()):
            target = variant / path
            target.parent.mkdir(parents=True, exist_ok=True)
            data = source.encode()
            target.write_bytes(data)
            digests[path] = file_digest(data)
        metadata = {
            "id": kernel_id,
            "name": KERNEL_NAME,
            "version": version,
            "license": LICENSE,
            "python-depends": [],
            "backend": {"type": backend},
            "digest": {"algorithm": "sha256", "files": digests},
        }
        (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        variants.append(variant)
    (out_dir / "README.md").write_text(_repository_card(version))
    return variants


def _repository_card(version: int) -> str:
    """The repository's README (the Hub shows it): what the layers replace and where the docs are."""
    return (f"---\nlicense: bsd-2-clause\ntags:\n- kernel\n---\n\n# liger-kernel (layers v{version})\n\n"
            f"liger_kernel {module_constant(PACKAGE, '__version__')}'s Triton kernels as a Hub kernel, built by "
            "`scripts/build_hub_kernel.py`. Layers: "
            + ", ".join(f"`{name}`" for name in module_constant(LAYERS_MODULE, "__all__"))
            + ". `LigerRMSNorm` and `LigerRotaryPosEmb` replace transformers' hub names `RMSNorm` and "
            "`rotary_pos_emb`; the others replace a class named in a `KernelConfig` through their "
            "`...Layout`. Usage and caveats: liger_kernel's docs/ecosystem.md.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the kernel repository to write (its build/ is replaced)")
    parser.add_argument("--backend", action="append", choices=BACKENDS, dest="backends",
                        help=f"a noarch variant to build (repeatable; default {' '.join(DEFAULT_BACKENDS)})")
    args = parser.parse_args(argv)
    for variant in build(args.out_dir, tuple(args.backends or DEFAULT_BACKENDS)):
        metadata = json.loads((variant / "metadata.json").read_text())
        print(f"{variant}: {metadata['id']}, version {metadata['version']}, {len(metadata['digest']['files'])} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
