"""The backend contract: DataLayout validation and the abstract TrainBackend."""

import dataclasses

import pytest
from miles_core.contract import DataLayout, TrainBackend


def test_data_layout_accepts_every_rank_of_the_group():
    for size in (1, 2, 8):
        for rank in range(size):
            layout = DataLayout(dp_rank=rank, dp_size=size)
            assert layout.consumes_data
    assert not DataLayout(dp_rank=1, dp_size=2, consumes_data=False).consumes_data


@pytest.mark.parametrize(
    ("rank", "size", "match"),
    [
        (0, 0, "dp_size must be >= 1, got 0"),
        (0, -2, "dp_size must be >= 1, got -2"),
        (-1, 4, r"dp_rank -1 outside \[0, 4\)"),
        (4, 4, r"dp_rank 4 outside \[0, 4\)"),
    ],
)
def test_data_layout_rejects_out_of_range(rank, size, match):
    with pytest.raises(ValueError, match=match):
        DataLayout(dp_rank=rank, dp_size=size)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dp_rank=0.0, dp_size=2), "dp_rank must be an int, got 0.0"),
        (dict(dp_rank=0, dp_size=True), "dp_size must be an int, got True"),
        (dict(dp_rank=0, dp_size=2, consumes_data=1), "consumes_data must be a bool, got 1"),
    ],
)
def test_data_layout_rejects_wrong_types(kwargs, match):
    # A torch.distributed rank read as a tensor or float would otherwise index shards wrongly.
    with pytest.raises(TypeError, match=match):
        DataLayout(**kwargs)


def test_data_layout_is_frozen():
    layout = DataLayout(dp_rank=0, dp_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dp_rank = 1


METHODS = (
    "init",
    "data_layout",
    "train",
    "compute_values",
    "update_weights",
    "save_model",
    "sleep",
    "wake_up",
    "close",
)


def test_the_contract_is_exactly_the_nine_methods():
    assert TrainBackend.__abstractmethods__ == frozenset(METHODS)


def _subclass_without(missing: str) -> type:
    body = {m: (lambda self, *a, **k: None) for m in METHODS if m != missing}
    return type(f"Without_{missing}", (TrainBackend,), body)


@pytest.mark.parametrize("missing", METHODS)
def test_an_incomplete_backend_cannot_be_instantiated(missing):
    cls = _subclass_without(missing)
    with pytest.raises(TypeError, match=missing):
        cls()


def test_a_complete_backend_instantiates_with_defaults():
    cls = _subclass_without("")
    backend = cls()
    assert cls.arg_groups() == ()
    assert backend.name == ""


def test_the_launchers_calls_are_the_contract():
    """Every method the trainer group calls on a backend is in ``TrainBackend`` with the
    arguments it passes (``compute_values`` for the critic, ``update_weights(weights=)``)."""
    import ast
    import inspect

    trainer_group = pytest.importorskip("miles_launch.trainer_group")

    tree = ast.parse(inspect.getsource(trainer_group))
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            on_backend = isinstance(owner, ast.Attribute) and owner.attr in ("backend", "critic")
            on_role = isinstance(owner, ast.Call) and getattr(owner.func, "attr", "") == "_role"
            on_model = (  # self.models[role]: each role's backend instance
                isinstance(owner, ast.Subscript)
                and isinstance(owner.value, ast.Attribute)
                and owner.value.attr == "models"
            )
            if on_backend or on_role or on_model:
                called.add(node.func.attr)
                params = inspect.signature(getattr(TrainBackend, node.func.attr)).parameters
                assert all(k.arg in params for k in node.keywords), (node.func.attr, params)
    assert {"compute_values", "update_weights", "train", "init"} <= called
    assert called <= set(METHODS), called - set(METHODS)
