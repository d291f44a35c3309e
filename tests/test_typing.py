"""The typing that ships with the package: lowbit/py.typed marks it typed (PEP 561), and lowbit/_C.pyi types
the native module, so the stub must say what csrc/bindings.cpp defines. The reference here is the built module
itself: its names, its values and the signatures pybind11 writes into each function's docstring."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import lowbit
from lowbit import _C

PACKAGE = Path(lowbit.__file__).parent
STUB = ast.parse((PACKAGE / "_C.pyi").read_text())


def _stub_functions() -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in STUB.body if isinstance(node, ast.FunctionDef)}


def _stub_constants() -> dict[str, str]:
    return {
        node.target.id: ast.unparse(node.annotation)
        for node in STUB.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def _runtime_names() -> set[str]:
    return {name for name in dir(_C) if not name.startswith("__")}


# pybind11's spelling of each argument type (pybind11/stl.h) -> the stub's.
_PYBIND_TYPES = {
    "typing.SupportsInt | typing.SupportsIndex": "int",
    "typing.SupportsFloat | typing.SupportsIndex": "float",
    "bool": "bool",
    "collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]": "list[int]",
    "collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex]": "list[float]",
    "collections.abc.Sequence[bool]": "list[bool]",
}


def _pybind_signature(fn: object) -> tuple[list[str], str]:
    """(argument types in the stub's spelling, return type) from the first docstring line pybind11 writes."""
    first = (fn.__doc__ or "").splitlines()[0]
    match = re.fullmatch(r"\w+\((.*)\) -> (.+)", first)
    assert match, f"unexpected pybind11 signature line: {first!r}"
    params, ret = match.groups()
    types = [_PYBIND_TYPES[t] for t in re.findall(r"arg\d+: ((?:[^,\[]|\[[^\]]*\])+)", params)]
    return types, ret


def test_the_package_ships_its_typing_marker_and_native_stub():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_C.pyi").is_file()


def test_the_stub_declares_every_name_of_the_native_module():
    declared = set(_stub_functions()) | set(_stub_constants())
    missing = _runtime_names() - declared
    assert not missing, f"lowbit/_C.pyi lacks {sorted(missing)} (defined in csrc/bindings.cpp)"
    # The stub also declares the CUDA launchers, which only a CUDA build has.
    extra = declared - _runtime_names()
    if not _C.cuda_built():
        extra = {name for name in extra if not name.endswith("_cuda")}
    assert not extra, f"lowbit/_C.pyi declares {sorted(extra)}, which lowbit._C does not define"


def test_the_stub_signatures_match_the_native_functions():
    stub = _stub_functions()
    for name in sorted(_runtime_names() & set(stub)):
        node = stub[name]
        assert not node.args.args and not node.args.kwonlyargs, f"{name}: pybind11 arguments are positional-only"
        got = [ast.unparse(a.annotation) for a in node.args.posonlyargs if a.annotation is not None]
        want, ret = _pybind_signature(getattr(_C, name))
        assert got == want, f"{name}: the stub takes {got}, the native function {want}"
        if ret in ("None", "bool"):
            assert ast.unparse(node.returns) == ret, name


def test_the_stub_cuda_launchers_mirror_the_cpu_loops():
    # <op>_cuda(args..., device, stream) where <op>_cpu takes (args..., threads) (bindings.cpp: def_loop).
    stub = _stub_functions()
    cpu_ops = [name.removesuffix("_cpu") for name in stub if name.endswith("_cpu")]
    assert cpu_ops
    for op in cpu_ops:
        cpu = [(a.arg, ast.unparse(a.annotation)) for a in stub[f"{op}_cpu"].args.posonlyargs if a.annotation]
        cuda = [(a.arg, ast.unparse(a.annotation)) for a in stub[f"{op}_cuda"].args.posonlyargs if a.annotation]
        assert cpu[-1] == ("threads", "int"), op
        assert cuda == cpu[:-1] + [("device", "int"), ("stream", "int")], op


def test_the_stub_constant_types_match_the_native_values():
    for name, annotation in _stub_constants().items():
        value = getattr(_C, name)
        expected = {"int": int, "tuple[str, ...]": tuple, "list[int]": list, "dict[str, int]": dict}[annotation]
        assert type(value) is expected, f"{name}: {type(value).__name__}, the stub says {annotation}"
        if isinstance(value, (tuple, list)):
            item = str if annotation == "tuple[str, ...]" else int
            assert all(type(v) is item for v in value), name
        if isinstance(value, dict):
            assert all(type(k) is str and type(v) is int for k, v in value.items()), name


def test_the_stub_typed_dicts_match_the_native_dicts():
    # BuildInfo and CudaVersions: the keys and value types of build_info() and cuda_versions().
    namespace: dict[str, object] = {}
    exec(compile(STUB, "_C.pyi", "exec"), namespace)  # a stub is valid Python; its functions are `...`
    for fn, typed in ((_C.build_info, namespace["BuildInfo"]), (_C.cuda_versions, namespace["CudaVersions"])):
        hints = typing.get_type_hints(typed)
        got = fn()
        assert set(got) == set(hints), f"{fn.__name__}() has keys {sorted(got)}; the stub's {sorted(hints)}"
        for key, value in got.items():
            assert type(value) is hints[key], f"{fn.__name__}()[{key!r}] is {type(value).__name__}"
