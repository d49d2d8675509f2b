"""Importing a model file as a fresh module, and the errors that name its contract.

The rest of the contract (what the file defines, how it is called) is in
:mod:`planner.plan.modelfile`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

__all__ = [
    "EXPECTED",
    "ModelFileError",
    "call_error",
    "contract_error",
    "exit_site",
    "import_fresh",
    "model_frame",
    "where",
]

EXPECTED = (
    "build_model(**overrides) -> nn.Module (required), "
    "sample_batch(batch_size) -> (inputs, targets) (required), "
    "loss_fn(outputs, targets) -> Tensor (optional), BATCH_SIZE: int (optional), "
    "dataset() -> map-style Dataset of (inputs, targets) samples (optional), "
    "collate(samples) -> (inputs, targets) (optional)"
)


class ModelFileError(ValueError):
    """A model file breaks the contract; the message names the file, the cause and the fix."""


def contract_error(path: Path, what: str, why: str, fix: str) -> ModelFileError:
    return ModelFileError(f"{path}: {what}\n  why: {why}\n  fix: {fix}\n  contract: {EXPECTED}")


def call_error(path: Path, call: str, exc: BaseException, why: str = "") -> ModelFileError:
    """The error for a model-file function that raised (or called ``sys.exit``) when called."""
    fn = call.split("(")[0]
    if isinstance(exc, SystemExit):  # reported as at import: the call, file:line, the fix
        code, at, _ = exit_site(exc, path)
        return contract_error(
            path,
            f"{call} called {code} at {at}",
            "a model file must return or raise, not exit: the planner cannot finish (or "
            "say why it stopped) when the file's code ends the process",
            f"return from {fn} (raise an exception that says what is wrong to stop)",
        )
    defaults = "; build_model is called with no arguments, so its parameters need defaults"
    return contract_error(
        path,
        f"{call} raised {type(exc).__name__}{where(exc, path)}: {exc}",
        why or "the planner needs the model and a sample batch to trace and profile it",
        f"fix the error in {fn} (the chained traceback shows the whole stack; `planner -v` "
        "prints it)" + (defaults if fn == "build_model" else ""),
    )


class _FreshSourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles from source every time: a quick edit never meets a stale ``.pyc``."""

    def get_code(self, fullname: str) -> types.CodeType:
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


def import_fresh(path: Path, name: str) -> types.ModuleType:
    """Import ``path`` as the module ``name``, compiled from source; errors name the fix."""
    spec = importlib.util.spec_from_file_location(
        name, path, loader=_FreshSourceLoader(name, str(path))
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    # In sys.modules while it runs: dataclasses, typing and pickle look classes
    # up there. A reload replaces the entry with the fresh module.
    sys.modules[name] = module
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, SyntaxError) and exc.lineno and exc.filename == str(path):
            line = f" at line {exc.lineno}"
        else:
            line = where(exc, path)
        if "torchvision::nms does not exist" in str(exc):
            raise contract_error(
                path,
                f"importing it raised {type(exc).__name__}{line}: {exc}",
                "torchvision's compiled operators did not load: this torchvision is built for "
                f"another build of torch ({_torch_version()}); transformers and timm import it",
                "install the torchvision built for this torch (for a CPU build: pip install "
                "torchvision --index-url https://download.pytorch.org/whl/cpu), or uninstall "
                "torchvision if the model does not need it",
            ) from exc
        raise contract_error(
            path,
            f"importing it raised {type(exc).__name__}{line}: {exc}",
            "the planner imports the model file to find build_model and sample_batch",
            f"fix the error (`python {path.name}` reproduces it; the chained traceback, "
            f"`planner -v`, shows the whole stack). Sibling modules in {folder} are importable",
        ) from exc
    finally:
        # Ours is at 0 unless the file edited sys.path; never drop an entry the user had.
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        elif folder in sys.path:
            sys.path.remove(folder)
    return module


def _torch_version() -> str:
    import torch

    return f"torch {torch.__version__}"


def where(exc: BaseException, path: Path) -> str:
    """' at line N (`source`)': the last line of ``path`` in the traceback, or ''."""
    import linecache
    import traceback

    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == str(path):
            found = lineno
    if found is None:
        return ""
    source = linecache.getline(str(path), found).strip()
    return f" at line {found}" + (f" (`{source}`)" if source else "")


def exit_site(exc: SystemExit, model_file: str | Path | None) -> tuple[str, str, bool]:
    """Who called ``sys.exit``: ``(call, where, in_model_file)`` for a ``SystemExit``.

    >>> try:
    ...     raise SystemExit(3)
    ... except SystemExit as e:
    ...     exit_site(e, None)[0]
    'sys.exit(3)'

    ``where`` is ``file:line in function`` of the model file's innermost frame
    in the traceback when it has one (``in_model_file`` True), else of the
    innermost frame. Shared by ``planner plan`` and the runtime's workers.
    """
    import traceback

    call = f"sys.exit({exc.code!r})" if exc.code is not None else "sys.exit()"
    mine = model_frame(exc, model_file)
    if mine is not None:
        return call, mine, True
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return call, "an unknown place", False
    return call, f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}", False


def model_frame(exc: BaseException, model_file: str | Path | None) -> str | None:
    """``file:line in function`` of the model file's innermost frame in ``exc``'s traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if model_file and _same_file(f.filename, model_file)]
    return f"{Path(mine[-1].filename).name}:{mine[-1].lineno} in {mine[-1].name}" if mine else None


def _same_file(a: str, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
