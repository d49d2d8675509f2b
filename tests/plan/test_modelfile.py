"""Tests for planner.plan.modelfile, batch and default_loss: the model-file contract."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from repo import EXAMPLES

from planner.plan.batch import Batch, normalize_inputs
from planner.plan.default_loss import default_loss
from planner.plan.modelfile import DEFAULT_BATCH_SIZE, ModelFile, ModelFileError, load_model_file

EXPECTED_NAMES = ("build_model", "sample_batch", "loss_fn", "BATCH_SIZE")

GOOD = """
import torch
from torch import nn

def build_model():
    return nn.Linear(4, 2)

def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
"""


def _write(folder: Path, source: str, name: str = "model.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def _load_error(path: Path) -> ModelFileError:
    with pytest.raises(ModelFileError) as info:
        load_model_file(path)
    return info.value


def _assert_teaches(err: Exception, path: Path) -> None:
    text = str(err)
    assert str(path) in text
    for name in EXPECTED_NAMES:
        assert name in text
    assert "fix:" in text


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    ("name", "batch_size", "has_loss"),
    [("mlp", 64, False), ("gpt", 8, True), ("resnet", 32, False), ("unet", 8, False)],
)
def test_examples_load(name: str, batch_size: int, has_loss: bool) -> None:
    mf = load_model_file(EXAMPLES / f"{name}.py")
    assert isinstance(mf, ModelFile)
    assert mf.path == (EXAMPLES / f"{name}.py").resolve()
    assert mf.batch_size == batch_size
    assert mf.has_loss_fn is has_loss
    assert mf.module.__name__.startswith("_planner_model_")


def test_defaults_and_a_minimal_file(tmp_path: Path) -> None:
    mf = load_model_file(str(_write(tmp_path, GOOD)))
    assert mf.batch_size == DEFAULT_BATCH_SIZE
    assert not mf.has_loss_fn
    batch = mf.sample(3)
    assert batch.size == 3 and batch.kwargs == {}
    out = mf.build()(*batch.args)
    assert mf.loss(out, batch.targets).dim() == 0


def test_module_name_never_clashes_with_a_users_module(tmp_path: Path) -> None:
    json_before = sys.modules["json"]
    mf = load_model_file(_write(tmp_path, GOOD, name="json.py"))
    assert sys.modules["json"] is json_before
    assert mf.module.__name__ != "json"
    assert sys.modules[mf.module.__name__] is mf.module


def test_loading_again_rereads_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "\nBATCH_SIZE = 4\n")
    first = load_model_file(path)
    path.write_text(textwrap.dedent(GOOD) + "\nBATCH_SIZE = 5\n")  # same size, same second
    second = load_model_file(path)
    assert (first.batch_size, second.batch_size) == (4, 5)
    assert second.module is not first.module
    assert not (tmp_path / "__pycache__").exists()


def test_sibling_import_works_and_sys_path_is_restored(tmp_path: Path) -> None:
    sibling = "_planner_test_sibling_helpers"
    _write(tmp_path, "WIDTH = 7\n", name=f"{sibling}.py")
    path = _write(
        tmp_path,
        f"""
        import torch
        from torch import nn
        from {sibling} import WIDTH

        def build_model():
            return nn.Linear(WIDTH, 1)

        def sample_batch(batch_size):
            return torch.randn(batch_size, WIDTH), torch.randn(batch_size, 1)
        """,
    )
    before = list(sys.path)
    try:
        mf = load_model_file(path)
        assert sys.path == before
        assert mf.build().in_features == 7
    finally:
        sys.modules.pop(sibling, None)


def test_sys_path_restored_when_import_fails(tmp_path: Path) -> None:
    before = list(sys.path)
    _load_error(_write(tmp_path, "import _planner_no_such_module_anywhere\n"))
    assert sys.path == before


# ----------------------------------------------------------------------------- load errors


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.py"
    err = _load_error(path)
    _assert_teaches(err, path)
    assert "no such file" in str(err)


def test_directory(tmp_path: Path) -> None:
    err = _load_error(tmp_path)
    _assert_teaches(err, tmp_path)
    assert "directory" in str(err)


def test_not_a_python_file(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD, name="model.txt")
    err = _load_error(path)
    _assert_teaches(err, path)
    assert "'.py'" in str(err)


def test_syntax_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "def build_model(:\n    pass\n")
    err = _load_error(path)
    _assert_teaches(err, path)
    assert "SyntaxError" in str(err) and "line 1" in str(err)
    assert isinstance(err.__cause__, SyntaxError)


def test_import_raising_keeps_the_cause(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "\nraise RuntimeError('no GPU here')\n")
    modules_before = set(sys.modules)
    err = _load_error(path)
    _assert_teaches(err, path)
    assert "RuntimeError" in str(err) and "no GPU here" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert err.__cause__.__traceback__ is not None
    assert set(sys.modules) == modules_before  # the half-imported module is not kept


def test_import_calling_sys_exit(tmp_path: Path) -> None:
    err = _load_error(_write(tmp_path, "import sys\nsys.exit(3)\n"))
    assert isinstance(err.__cause__, SystemExit)


def test_missing_sample_batch_lists_present_and_missing(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        from torch import nn
        BATCH_SIZE = 4
        def build_model():
            return nn.Linear(2, 2)
        def sample_batchs(n):
            pass
        """,
    )
    err = _load_error(path)
    _assert_teaches(err, path)
    text = str(err)
    assert "missing sample_batch" in text
    assert "present: build_model, BATCH_SIZE" in text
    assert "did you mean sample_batchs" in text


def test_nothing_defined(tmp_path: Path) -> None:
    err = _load_error(_write(tmp_path, "x = 1\n"))
    assert "missing build_model, sample_batch" in str(err)
    assert "none of the expected names" in str(err)


def test_not_callable(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "\nloss_fn = 3\n")
    err = _load_error(path)
    _assert_teaches(err, path)
    assert "not callable: loss_fn" in str(err)


@pytest.mark.parametrize("value", ["0", "-2", "'8'", "True", "2.0"])
def test_bad_batch_size(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, GOOD + f"\nBATCH_SIZE = {value}\n")
    err = _load_error(path)
    _assert_teaches(err, path)
    assert "BATCH_SIZE" in str(err) and "positive int" in str(err)


# ----------------------------------------------------------------------------- call errors


def test_build_model_returning_a_non_module(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "\ndef build_model():\n    return {'model': 1}\n")
    mf = load_model_file(path)
    with pytest.raises(ModelFileError) as info:
        mf.build()
    _assert_teaches(info.value, mf.path)
    assert "returned dict, not a torch.nn.Module" in str(info.value)


def test_build_model_raising_keeps_the_cause(tmp_path: Path) -> None:
    mf = load_model_file(_write(tmp_path, GOOD + "\ndef build_model(width):\n    pass\n"))
    with pytest.raises(ModelFileError, match="build_model\\(\\) raised TypeError") as info:
        mf.build()
    assert isinstance(info.value.__cause__, TypeError)


def test_sample_batch_returning_three_things(tmp_path: Path) -> None:
    src = GOOD + "\ndef sample_batch(n):\n    return torch.zeros(n, 4), torch.zeros(n), None\n"
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError) as info:
        mf.sample(2)
    _assert_teaches(info.value, mf.path)
    assert "tuple of length 3" in str(info.value)


def test_sample_batch_wrong_batch_dim(tmp_path: Path) -> None:
    src = GOOD + "\ndef sample_batch(n):\n    return torch.zeros(n + 1, 4), torch.zeros(n + 1)\n"
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError) as info:
        mf.sample(4)
    _assert_teaches(info.value, mf.path)
    assert "batch dimension 5" in str(info.value) and "should be 4" in str(info.value)


def test_sample_batch_targets_wrong_batch_dim(tmp_path: Path) -> None:
    src = GOOD + "\ndef sample_batch(n):\n    return torch.zeros(n, 4), torch.zeros(1, 3)\n"
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError, match=r"targets of shape\(s\) \[\(1, 3\)\]"):
        mf.sample(4)


def test_sample_batch_unusable_inputs(tmp_path: Path) -> None:
    src = GOOD + "\ndef sample_batch(n):\n    return 'text', torch.zeros(n)\n"
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError, match="unusable inputs") as info:
        mf.sample(2)
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(ValueError, match="positive int"):
        mf.sample(0)


def test_loss_fn_must_return_a_scalar(tmp_path: Path) -> None:
    src = GOOD + "\ndef loss_fn(out, y):\n    return out.sum(dim=1)\n"
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError, match="not a scalar tensor"):
        mf.loss(torch.zeros(3, 2), torch.zeros(3))
    assert mf.has_loss_fn


# ----------------------------------------------------------------------------- inputs


def test_normalize_inputs() -> None:
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert normalize_inputs(x) == ((x,), {})
    args, kwargs = normalize_inputs((x, y))
    assert args[0] is x and args[1] is y and kwargs == {}
    assert normalize_inputs([x])[0][0] is x
    args, kwargs = normalize_inputs({"idx": x, "mask": None})
    assert args == () and kwargs["idx"] is x and kwargs["mask"] is None
    with pytest.raises(TypeError, match="expected a Tensor"):
        normalize_inputs(3)
    with pytest.raises(TypeError, match="not strings"):
        normalize_inputs({0: x})


def test_batch_size_reads_the_first_tensor() -> None:
    assert Batch(args=(None, torch.zeros(5, 2)), kwargs={}, targets=None).size == 5
    assert Batch(args=(), kwargs={"x": [torch.zeros(6)]}, targets=None).size == 6
    with pytest.raises(ValueError, match="no batch dimension"):
        _ = Batch(args=(1,), kwargs={}, targets=None).size
    with pytest.raises(ValueError, match="no batch dimension"):
        _ = Batch(args=(torch.tensor(1.0),), kwargs={}, targets=None).size


def test_batch_inputs_are_one_kind_as_the_step_takes_them() -> None:
    x = torch.zeros(4, 3)
    assert Batch(args=(x,), kwargs={}).inputs() == (x,)
    assert Batch(args=(), kwargs={"ids": x}).inputs() == {"ids": x}
    assert normalize_inputs(Batch(args=(), kwargs={"ids": x}).inputs()) == ((), {"ids": x})
    with pytest.raises(ValueError, match="both positional and keyword"):
        Batch(args=(x,), kwargs={"mask": x}).inputs()


# ----------------------------------------------------------------------------- default loss


def test_default_loss_classifier() -> None:
    out, y = torch.randn(4, 10), torch.randint(0, 10, (4,))
    assert torch.allclose(default_loss(out, y), F.cross_entropy(out, y))


def test_default_loss_language_model() -> None:
    out, y = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    expected = F.cross_entropy(out.reshape(-1, 11), y.reshape(-1))
    assert torch.allclose(default_loss(out, y), expected)


def test_default_loss_segmentation() -> None:
    out, y = torch.randn(2, 4, 6, 7), torch.randint(0, 4, (2, 6, 7))
    assert torch.allclose(default_loss(out, y), F.cross_entropy(out, y))


def test_default_loss_ambiguous_shapes() -> None:
    # Both layouts fit; 4-D outputs are read channels-first, 3-D ones class-last.
    out, y = torch.randn(2, 4, 4, 4), torch.randint(0, 4, (2, 4, 4))
    assert torch.allclose(default_loss(out, y), F.cross_entropy(out, y))
    out, y = torch.randn(2, 3, 3), torch.randint(0, 3, (2, 3))
    assert torch.allclose(default_loss(out, y), F.cross_entropy(out.reshape(-1, 3), y.flatten()))


def test_default_loss_float_targets() -> None:
    out, y = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.allclose(default_loss(out, y), F.mse_loss(out, y))
    with pytest.raises(ValueError, match="equal shapes"):
        default_loss(out, torch.randn(3))


def test_default_loss_picks_the_main_output() -> None:
    logits, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    expected = F.cross_entropy(logits, y)
    other = torch.randn(4, 9)
    assert torch.allclose(default_loss({"hidden": other, "logits": logits}, y), expected)
    assert torch.allclose(default_loss({"first": logits, "second": other}, y), expected)
    assert torch.allclose(default_loss((logits, other), y), expected)


def test_default_loss_errors() -> None:
    with pytest.raises(ValueError, match="fit neither"):
        default_loss(torch.randn(4, 3), torch.randint(0, 3, (5,)))
    with pytest.raises(TypeError, match="loss_fn"):
        default_loss(torch.randn(4, 3), [1, 2])
    with pytest.raises(TypeError, match="loss_fn"):
        default_loss("text", torch.zeros(4))
