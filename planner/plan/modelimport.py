"""Importing a model file as a fresh module, and the errors that name its contract.

The rest of the contract (what the file defines, how it is called) is in
:mod:`planner.plan.modelfile`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

__all__ = ["EXPECTED", "ModelFileError", "contract_error", "import_fresh", "where"]

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
