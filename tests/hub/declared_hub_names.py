"""The hub names transformers' modeling code declares, applied with ``kernels``' own decorators
where transformers left them out.

transformers marks its layers for ``kernels.kernelize`` with ``@use_kernel_forward_from_hub("RMSNorm")``
on a class or a function and ``@use_kernelized_func(apply_rotary_pos_emb)`` on the class calling that
function, forwarding to the ``kernels`` decorators of the same names, but only when it accepts the
installed ``kernels`` version (``transformers.utils.is_kernels_available()``); otherwise its decorators
return their argument unchanged. transformers 5.17 accepts 0.16.0 <= kernels < 0.17.0, so beside
kernels 0.19 its classes carry no hub name and ``kernelize`` passes over them. The tests that drive
``kernels.kernelize`` directly then apply the decorators the modeling source declares, with the
``kernels`` functions transformers forwards to, and restore the module after the test.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect

import kernels
import pytest

# transformers' names of the decorators forwarding to kernels.use_kernel_forward_from_hub
# (use_kernel_func_from_hub: its deprecated alias since 5.16).
FORWARD_DECORATORS = ("use_kernel_forward_from_hub", "use_kernel_func_from_hub")


@functools.cache
def declared_decorators(module_name: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """``(hub name per decorated class or function, function names per class decorated with
    use_kernelized_func)`` as the top-level definitions of the module's source declare them."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    hub_names: dict[str, str] = {}
    kernelized_funcs: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)):
                continue
            if decorator.func.id in FORWARD_DECORATORS:
                (name,) = decorator.args
                hub_names[node.name] = ast.literal_eval(name)
            elif decorator.func.id == "use_kernelized_func":
                functions = decorator.args
                if len(functions) == 1 and isinstance(functions[0], ast.List):  # the list form
                    functions = functions[0].elts
                kernelized_funcs[node.name] = tuple(function.id for function in functions)
    return hub_names, kernelized_funcs


def apply_declared_hub_names(monkeypatch: pytest.MonkeyPatch, module_name: str) -> list[str]:
    """Apply the module's declared hub decorators that transformers did not (undone with
    ``monkeypatch``); returns the names of the definitions decorated here."""
    module = importlib.import_module(module_name)
    hub_names, kernelized_funcs = declared_decorators(module_name)
    applied = []
    for name, hub_name in hub_names.items():
        target = getattr(module, name)
        if hasattr(target, "kernel_layer_name"):  # transformers applied it
            continue
        if inspect.isclass(target):
            for attribute in ("kernel_layer_name", "kernel_condition"):
                monkeypatch.setattr(target, attribute, None, raising=False)  # removed again on undo
            kernels.replace_kernel_forward_from_hub(target, hub_name)
        else:  # a function becomes an instance of a hub-named module, as the module global
            monkeypatch.setattr(module, name, kernels.use_kernel_forward_from_hub(hub_name)(target))
        applied.append(name)
    for name, functions in kernelized_funcs.items():
        undecorated = [function in applied for function in functions]
        if not any(undecorated):  # transformers applied it along with its functions' hub names
            continue
        assert all(undecorated), (name, functions, applied)
        cls = getattr(module, name)
        for attribute in ("__init__", "forward"):
            monkeypatch.setattr(cls, attribute, getattr(cls, attribute))
        kernels.use_kernelized_func(*(getattr(module, function) for function in functions))(cls)
        applied.append(name)
    return applied
